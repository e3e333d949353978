"""Configuration of the deploy stage."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from aerie.configbase import StrictModel


class DeployConfig(StrictModel):
    """Serve the drafter with speculative decoding, benchmark against a baseline, promote if it pays."""

    enabled: bool = Field(True, description="Run the deployment benchmark.")
    engine: Literal["sglang", "vllm"] = Field(
        "sglang",
        description="The serving engine the benchmark measures: sglang = server.backend's server (SGLang, "
        "or aerie's reference server, which speaks SGLang's API); vllm = `vllm serve` with the drafter's "
        "vllm/ folder as its EAGLE-3 speculative model (refused at load where aerie cannot run it).",
    )
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
    warmup_requests: int = Field(
        2,
        ge=0,
        description="Warm-up, not measured: this many requests one after another before a server's first "
        "level, then before each level one untimed pass of that level's workload (0: no warm-up).",
    )
    request_timeout_s: float = Field(600.0, gt=0, description="Per-request HTTP timeout of the benchmark.")
    promote_margin: float = Field(1.05, gt=0, description="Promote when speed-up >= this.")
    promote_concurrency: int | None = Field(
        None,
        ge=1,
        description="Concurrency level whose speed-up decides promotion; None = the lowest benchmarked "
        "(speculative decoding pays at low batch; at high batch the baseline's batching catches up).",
    )

    @model_validator(mode="after")
    def _levels_make_sense(self) -> DeployConfig:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency must list positive levels, got {self.concurrency}")
        if self.promote_concurrency is not None and self.promote_concurrency not in self.concurrency:
            raise ValueError(
                f"promote_concurrency {self.promote_concurrency} is not one of concurrency {self.concurrency}"
            )
        if self.eagle_topk == 1 and self.num_draft_tokens not in (None, self.num_steps + 1):
            raise ValueError(
                f"with eagle_topk 1 a chain verifies num_steps+1 = {self.num_steps + 1} tokens; "
                f"num_draft_tokens {self.num_draft_tokens} contradicts it (SGLang would override it)"
            )
        return self
