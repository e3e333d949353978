"""The extraction stage through real SGLang on this CPU (the process launcher, SGLang's own environment,
aerie's dump plugin) for the tiny targets of the architectures SGLang's CPU engine runs: Llama-3
(llama3 RoPE scaling), Qwen3 (head_dim != hidden/heads, q/k norms) and Qwen3-MoE (routed experts
through SGLang's CPU MoE path). Each extracts a few ShareGPT conversations merged with the target's own
tokenizer and template; the canary's numeric check against a transformers forward of the same target
must pass, at the layers aerie captures. DeepSeek-V3, the Kimi-shaped target and GPT-OSS are refused
before any launch on the CPU (tests/test_architectures.py names SGLang's limitation for each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aerie.extract import work
from aerie.extract.config import ExtractConfig
from aerie.manifest import load_manifest
from aerie.store import LocalStore
from aerie.targets import TargetConfig, resolve_target
from tests.evaluate_support import corpus_result
from tests.processes import free_port
from tests.sglang_support import cpu_config, shim_calls
from tests.stage_work import staged
from tests.tiny_targets import build_target

run = staged("extract", work.run)

# One SGLang start per architecture (about a minute each on a 2-core machine).
pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(900)]

SGLANG_ON_CPU = ("llama3", "qwen3", "qwen3_moe")


@pytest.mark.parametrize("arch", SGLANG_ON_CPU)
def test_sglang_extracts_every_cpu_architecture_and_the_canary_passes(
    arch: str, smollm2, tmp_path: Path
) -> None:
    target = resolve_target(TargetConfig(name=str(build_target(arch, tmp_path / arch, smollm2.path))))
    store = LocalStore(tmp_path / "store")
    corpus = corpus_result(store, arch, target, n=4)
    calls = tmp_path / "shim-calls"
    result = run(
        ExtractConfig(
            storage_dtype="bf16",
            work_dir=str(tmp_path / "work"),
            canary_reference="always",
            shard_bytes=1 << 20,
            batch_tokens=256,
            requests_in_flight=1,
        ),
        store=store,
        run_name=arch,
        target=target,
        corpus=corpus,
        server=cpu_config(free_port(), calls),
    )
    manifest = load_manifest(store, result.prefix)
    numeric = manifest["canary"]["numeric"]
    assert numeric is not None, "the numeric check against transformers did not run"
    print(arch, {k: v for k, v in numeric.items() if k != "blocks"}, numeric["blocks"])
    assert [b["best"] for b in numeric["blocks"]] == target.aux_layers_input
    assert manifest["layers"]["input_of_layer"] == target.aux_layers_input
    assert result.figures["tokens"] == corpus.figures["tokens"] > 0
    assert shim_calls(calls) == []
