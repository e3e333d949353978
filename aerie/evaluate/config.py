"""Configuration of the evaluation and deployment stages."""

from __future__ import annotations

from pydantic import Field

from aerie.configbase import StrictModel


class EvaluateConfig(StrictModel):
    """Offline speculative decoding with the target and the trained drafter."""

    num_steps: list[int] = Field(
        default_factory=lambda: [3, 7], description="Draft chain lengths to evaluate."
    )
    max_new_tokens: int = Field(128, ge=1, description="Tokens generated per prompt.")
    mtbench_questions: int | None = Field(None, ge=1, description="MT-Bench questions used; None = all 80.")
    heldout_samples: int = Field(32, ge=0, description="Held-out corpus prompts evaluated.")
    device: str = Field("auto", description="auto, cpu or cuda.")


class DeployConfig(StrictModel):
    """Serve the drafter with speculative decoding, benchmark against a baseline, promote if it pays."""

    enabled: bool = Field(True, description="Run the deployment benchmark.")
    concurrency: list[int] = Field(
        default_factory=lambda: [1, 8, 32], description="Benchmark concurrency levels."
    )
    num_prompts: int = Field(32, ge=1, description="Prompts per concurrency level.")
    max_new_tokens: int = Field(128, ge=1, description="Tokens generated per prompt.")
    num_steps: int = Field(3, ge=1, description="--speculative-num-steps of the deployed server.")
    eagle_topk: int = Field(1, ge=1, description="--speculative-eagle-topk.")
    num_draft_tokens: int | None = Field(
        None, ge=2, description="--speculative-num-draft-tokens; None = steps+1."
    )
    promote_margin: float = Field(1.05, gt=0, description="Promote when speed-up >= this.")
