"""SGLang's own n-gram speculation served by real SGLang on this CPU, as the deploy stage launches it
(`server_specs`: no drafter, `--max-running-requests` of the highest level), measured at steady state by
the deploy benchmark, its acceptance read from SGLang itself (per request and from /server_info). EAGLE-3
speculation does not run on SGLang's CPU engine; the reference server covers the drafter (test_deploy).

Speculation on SGLang's CPU engine builds a KV pool whose warm-up calls `sgl_kernel`'s compiled CPU op
`copy_all_layer_kv_cache_cpu`: where SGLang's environment has no CPU build of sgl_kernel (PyPI has none;
the CPU lane stands a shim in for it, tests/sglang_cpu_shims) the server dies at that call, so the test
runs only where the real package is installed, and says why otherwise."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from aerie.deploy.bench import benchmark, engine_accept_length
from aerie.deploy.config import DeployConfig
from aerie.deploy.work import server_specs
from aerie.evaluate.prompts import mtbench_prompts
from aerie.serving import ModelServer
from tests.conftest import free_port
from tests.sglang_support import cpu_config, sglang_python

pytestmark = [pytest.mark.sglang, pytest.mark.integration, pytest.mark.slow]


def _real_sgl_kernel() -> bool:
    """Whether SGLang's environment holds a real sgl_kernel (the shims are not on this path)."""
    found = subprocess.run(
        [sglang_python(), "-c", "import importlib.util as u; print(u.find_spec('sgl_kernel') is not None)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return found.stdout.strip() == "True"


def test_sglang_serves_ngram_speculation_at_steady_state_and_reports_its_acceptance(
    smollm2, tmp_path: Path
) -> None:
    if not _real_sgl_kernel():
        pytest.skip(
            "SGLang's speculative KV pool calls sgl_kernel.copy_all_layer_kv_cache_cpu, and this SGLang "
            "environment has no CPU build of sgl_kernel (only the CPU lane's shim)"
        )
    cfg = DeployConfig(concurrency=[1, 2], num_steps=2, ngram="on", ngram_draft_tokens=4)
    server = cpu_config(free_port(), tmp_path / "calls.txt", startup_timeout_s=900)
    drafter = tmp_path / "drafter"  # the EAGLE-3 launch is built but not started here
    drafter.mkdir()
    spec = server_specs(cfg, server, smollm2, str(drafter))["ngram"]
    assert spec.command[spec.command.index("--speculative-algorithm") + 1] == "NGRAM"
    assert spec.command[spec.command.index("--max-running-requests") + 1] == "2"
    # MT-Bench prompts repeat their own words: n-gram lookup finds drafts in them.
    prompts = [p.input_ids for p in mtbench_prompts(smollm2.load_tokenizer(), None, 512)][:4]
    with ModelServer(spec.with_(log_path=tmp_path / "ngram.log")) as live:
        results, outputs = benchmark(
            live.url,
            "ngram",
            prompts,
            cfg.concurrency,
            12,
            warmup=1,
            seconds=0.5,
            requests_per_slot=1,
            repeats=2,
        )
        engine = engine_accept_length(live.url)
    for level in results:
        assert level.repeats == 2 and len(level.tokens_per_s_runs) == 2 and level.output_tokens_per_s > 0
        assert level.window_s is not None and level.window_s >= 0.5 and (level.requests_per_slot or 0) >= 1
        # SGLang's per-request counts: Σ completion tokens / Σ verify rounds, at least one token a round.
        assert level.accept_length is not None and level.accept_length >= 1.0
    assert engine is not None and engine >= 1.0  # SGLang's own running figure (/server_info)
    assert all(len(outs) == len(prompts) for outs in outputs.values())
