"""The train flow under a real Prefect test server: tiny synthetic shards -> a drafter, with the progress
artifact, figures and per-step tables and both plots as image artifacts; the second run is a cache hit."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from prefect.client.orchestration import get_client

from aerie.config import PipelineConfig
from aerie.serving import ServerConfig
from aerie.stage import Upstream
from aerie.store import LocalStore, StoreConfig
from aerie.train.config import TrainConfig
from flows.stage import run_stage
from tests.conftest import free_port
from tests.train_support import make_samples, make_upstream, tiny_target

pytest_plugins = ("tests.prefect_support",)
# integration: a Prefect test server (one harness for every flow module)
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_harness")]


async def _artifacts() -> dict[str, str]:
    async with get_client() as client:
        return {a.key: a.type for a in await client.read_artifacts() if a.key}


def test_flow_trains_reports_and_caches(tmp_path):
    torch.set_num_threads(1)
    target, model = tiny_target(tmp_path)
    up = make_upstream(
        tmp_path,
        target,
        make_samples(model, target, n=4, prompt=6, response=26),
        make_samples(model, target, n=1, prompt=6, response=26, seed=1),
    )
    cfg = PipelineConfig(
        run="flow",
        store=StoreConfig(uri=up.store.root),
        train=TrainConfig(
            drafter={"family": "eagle3", "draft_vocab_size": 128, "ttt_length": 2},
            epochs=4,
            batch_tokens=64,
            max_length=64,
            eval_every=2,
            checkpoint_every=4,
            device="cpu",
        ),  # fmt: skip
    )
    upstream = Upstream().plus("merge", [up.corpus]).plus("extract", [up.shards])
    (first,) = run_stage("train", cfg, target, upstream)
    assert not first.cache_hit and first.figures["steps"] == 8
    assert up.store.exists(f"{first.prefix}/drafter/model.safetensors")
    artifacts = asyncio.run(_artifacts())
    assert artifacts["flow-train"] == "progress"
    assert artifacts["train-figures"] == "table" and artifacts["train-steps"] == "table"
    assert artifacts["train-loss"] == "markdown" and artifacts["train-accuracy"] == "markdown"
    (second,) = run_stage("train", cfg, target, upstream)
    assert second.manifest_sha256 == first.manifest_sha256


def test_an_online_training_reports_its_servers(tmp_path, smollm2):
    """train.source online under Prefect: the stage's own reference server feeds it, and the
    `train-servers` table says how that server ended and what it served."""
    from tests.online_support import RUN, corpus_with_counts, extract_config, train_config

    torch.set_num_threads(1)
    target, _ = tiny_target(tmp_path)
    # A tokenizer for the server to load (the pipeline's server config takes no ids-only flag); the
    # corpus holds token ids of the tiny target's vocabulary all the same.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(smollm2.path) / name, Path(target.path) / name)
    store = LocalStore(tmp_path / "store")
    corpus = corpus_with_counts(store, tmp_path, target, train=6, held=2)
    cfg = PipelineConfig(
        run=RUN,
        store=StoreConfig(uri=store.root),
        train=train_config(tmp_path, source="online"),
        extract=extract_config(tmp_path),
        # Its warm-up would send the tokenizer's ids, outside the tiny vocabulary.
        server=ServerConfig(device="cpu", port=free_port(), extra_args=["--skip-server-warmup"]),
    )
    (result,) = run_stage("train", cfg, target, Upstream().plus("merge", [corpus]))
    assert result.figures["source"] == "online" and result.figures["servers"] == 1
    (table,) = asyncio.run(_artifact_data("train-servers"))
    (row,) = json.loads(table)
    assert row["backend"] == "reference" and row["state"] == "stopped" and row["restarts"] == 0
    assert row["address"] == f"http://127.0.0.1:{cfg.server.port}" and row["requests"] > 0


async def _artifact_data(key: str) -> list[str]:
    async with get_client() as client:
        return [a.data for a in await client.read_artifacts() if a.key == key]  # type: ignore[misc]
