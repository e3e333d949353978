"""The train flow under a real Prefect test server: tiny synthetic shards -> a drafter, with the progress
artifact, figures and per-step tables and both plots as image artifacts; the second run is a cache hit."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prefect.client.orchestration import get_client

from aerie.config import PipelineConfig
from aerie.stage import Upstream
from aerie.store import StoreConfig
from aerie.train.config import TrainConfig
from flows.stage import run_stage
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
            draft_vocab_size=128,
            ttt_length=2,
            epochs=4,
            batch_tokens=64,
            max_length=64,
            eval_every=2,
            checkpoint_every=4,
            device="cpu",
        ),  # fmt: skip
    )
    upstream = Upstream().plus("merge", [up.corpus]).plus("extract", [up.shards])
    first = run_stage("train", cfg, target, upstream)
    assert not first.cache_hit and first.figures["steps"] == 8
    assert up.store.exists(f"{first.prefix}/drafter/model.safetensors")
    artifacts = asyncio.run(_artifacts())
    assert artifacts["flow-train"] == "progress"
    assert artifacts["train-figures"] == "table" and artifacts["train-steps"] == "table"
    assert artifacts["train-loss"] == "markdown" and artifacts["train-accuracy"] == "markdown"
    second = run_stage("train", cfg, target, upstream)
    assert second.manifest_sha256 == first.manifest_sha256
