"""The embedded default with `train.drafter=dflash`, extract -> train -> evaluate on the CPU (tiny budgets):
the reference server captures DFlash's five layers, the train stage trains the block drafter through the
family's objective, and the evaluator measures it with the family's proposer, losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aerie.config import apply_overrides
from aerie.draft.dflash_export import load_dflash
from aerie.manifest import load_manifest
from aerie.pipeline import run_pipeline
from aerie.presets import get_preset
from aerie.progress import no_progress
from aerie.shards.keys import shard_keys
from aerie.shards.reader import ShardReader
from aerie.store import open_store
from aerie.targets import resolve_target
from tests import pipeline_support
from tests.conftest import free_port

pytestmark = pytest.mark.integration  # reference servers (generation and extraction)

DFLASH = [
    "train.drafter=dflash",
    "train.drafter.block_size=4",
    "train.drafter.anchors_per_sequence=32",
    "deploy.enabled=false",
    "evaluate.temperatures=[0]",
]


@pytest.mark.timeout(900)
def test_a_dflash_drafter_runs_extract_train_evaluate_on_the_embedded_default(tmp_path: Path) -> None:
    store_dir = tmp_path / "artifacts"
    overrides = pipeline_support.tiny_overrides(store_dir, run="dflash", port=free_port())
    cfg = apply_overrides(get_preset("smollm2-local"), [*overrides, *DFLASH])
    report = run_pipeline(cfg, until="evaluate", progress=lambda _name: no_progress)
    by_stage = {r.stage: r for r in report.results}
    store = open_store(cfg.store)
    target = resolve_target(cfg.target)

    # Extraction captured the family's layers: five spread over the 30-layer target, in every shard.
    extract = load_manifest(store, by_stage["extract"].prefix)
    assert extract["layers"]["output_of_layer"] == [1, 8, 14, 21, 27]
    assert extract["config"]["capture_layers"] == [1, 8, 14, 21, 27]
    local = store.local_path(shard_keys(extract, by_stage["extract"].prefix)[0][0])
    assert local is not None
    assert ShardReader(local).token_slice(0, 1)["aux_hidden"].shape[1] == 5 * target.geometry.hidden_size
    assert extract["canary"]["numeric"]["blocks"][4]["expected"] == 28  # compared with a real forward

    # Training ran the block objective and exported the directory SGLang's DFLASH worker loads.
    train = load_manifest(store, by_stage["train"].prefix)
    assert train["family"] == "dflash"
    assert train["drafter_config"]["architectures"] == ["DFlashDraftModel"]
    assert train["drafter_config"]["dflash_config"]["target_layer_ids"] == [1, 8, 14, 21, 27]
    assert len(train["final"]["eval"]["acc"]) == 3  # one column per drafted slot of a 4-token block
    drafter_dir = store.local_path(f"{by_stage['train'].prefix}/drafter")
    assert drafter_dir is not None
    assert load_dflash(drafter_dir, target).config.block_size == 4

    # The evaluator measured the drafter's proposer (named by its family) beside prompt lookup.
    evaluation = by_stage["evaluate"].figures
    measured = {k: v for k, v in evaluation.items() if k.startswith("accept_")}
    print("DFlash tiny pipeline, measured acceptance:", json.dumps(measured, sort_keys=True))
    dflash = [k for k in measured if "_dflash_k3" in k]
    assert dflash and all(1.0 <= measured[k] <= 4.0 for k in dflash), measured
    assert any("_prompt_lookup_k3" in k for k in measured)
    identical, compared = map(int, evaluation["outputs_identical"].split("/"))
    assert compared > 0 and identical == compared  # greedy drafts never change the target's output
