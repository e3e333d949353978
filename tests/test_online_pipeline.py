"""The embedded default with `train.source=online`, generate -> merge -> train on the CPU (tiny budgets): no
extract stage runs, the train stage's own reference server feeds the trainer, and the store holds no
hidden-state shard, only the corpus, the checkpoints and the drafter."""

from __future__ import annotations

from pathlib import Path

import pytest

from aerie.config import apply_overrides
from aerie.manifest import load_manifest
from aerie.pipeline import run_pipeline
from aerie.presets import get_preset
from aerie.progress import no_progress
from aerie.store import open_store
from tests import pipeline_support
from tests.conftest import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # reference servers (generation and training)


@pytest.mark.timeout(900)
def test_the_embedded_default_trains_online_and_writes_no_shards(tmp_path: Path) -> None:
    store_dir = tmp_path / "artifacts"
    overrides = pipeline_support.tiny_overrides(store_dir, run="online", port=free_port())
    cfg = apply_overrides(get_preset("smollm2-local"), [*overrides, "train.source=online"])
    report = run_pipeline(cfg, until="train", progress=lambda _name: no_progress)
    by_stage = {r.stage: r for r in report.results}
    assert list(by_stage) == ["generate-sharegpt", "merge", "train"]

    store = open_store(cfg.store)
    keys = store.list("online")
    assert not any("/extract/" in k or ("shard" in k.rsplit("/", 1)[-1]) for k in keys), keys
    assert any(k.endswith("/drafter/model.safetensors") for k in keys)
    train = load_manifest(store, by_stage["train"].prefix)
    assert train["training"]["config"]["source"] == "online"
    assert train["online"]["shard_bytes_written"] == 0
    (rank,) = train["online"]["ranks"]
    (server,) = rank["servers"]
    assert server["backend"] == "reference" and server["starts"] == 1 and server["state"] == "stopped"
    assert rank["extracted_tokens"] >= by_stage["merge"].figures["train_tokens"]  # every epoch extracts again
    figures = by_stage["train"].figures
    assert figures["source"] == "online" and figures["server_restarts"] == 0 and figures["steps"] > 0
