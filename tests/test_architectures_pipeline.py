"""Each target architecture (tests/tiny_targets.py) through the whole pipeline on the reference server,
as a user runs it (`aerie run smollm2-local target.name=DIR --no-prefect`): generate with the target
itself, merge with its own tokenizer and chat template, extract its hidden states, train a drafter,
evaluate it with speculative decoding (several prompts a batch, the default) and the deployment
benchmark. No setting is changed for an architecture but the Kimi-shaped target's: its own tokenizer code
is trusted, and it generates in instant mode (`thinking: false`, the template's closed `<think></think>`).
In thinking mode random weights never close the `<think>` block within 16 tokens, so every answer is
reasoning only and refused as empty, as it should be (docs/thinking.md; tests/test_thinking_*.py cover
the thinking path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aerie.config import apply_overrides
from aerie.pipeline import run_pipeline
from aerie.presets import get_preset
from aerie.progress import no_progress
from tests import pipeline_support
from tests.conftest import free_port
from tests.tiny_targets import ARCHITECTURES, build_target

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # reference servers; a minute or more each

STAGES = ["generate-sharegpt", "merge", "extract", "train", "evaluate", "deploy"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_stage_runs_on_the_reference_server(arch: str, smollm2, tmp_path: Path) -> None:
    target = build_target(arch, tmp_path / arch, smollm2.path)
    overrides = [
        *pipeline_support.tiny_overrides(tmp_path / "artifacts", run=arch, port=free_port()),
        f"target.name={target}",
    ]
    if arch == "kimi":
        overrides += [
            "target.trust_remote_code=true",
            "generate.datasets.0.sampling.extra_body={chat_template_kwargs: {thinking: false}}",
        ]
    report = run_pipeline(
        apply_overrides(get_preset("smollm2-local"), overrides),
        until="deploy",
        progress=lambda _n: no_progress,
    )
    results = {r.stage: r for r in report.results}
    assert list(results) == STAGES
    assert results["extract"].figures["tokens"] == results["merge"].figures["tokens"] > 0
    evaluate = results["evaluate"].figures
    print(arch, {s: round(r.seconds, 1) for s, r in results.items()}, evaluate)
    assert all(Path(r.manifest_uri).is_file() for r in results.values())
    same, total = map(int, str(evaluate["outputs_identical"]).split("/"))
    assert same == total > 0  # speculative decoding of batched prompts gave the target's own greedy output
