"""The evaluate and deploy flows under a real Prefect test server: the report as a markdown artifact,
the acceptance plot as an image, progress and figures; a second run is a cache hit."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prefect.client.orchestration import get_client

from aerie.config import PipelineConfig
from aerie.deploy.config import DeployConfig
from aerie.evaluate.config import EvaluateConfig
from aerie.stage import Upstream
from aerie.store import LocalStore, StoreConfig
from flows.stage import run_stage
from tests.evaluate_support import corpus_result, train_result

pytest_plugins = ("tests.prefect_support",)
# integration: a Prefect test server (one harness for every flow module)
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_harness")]


async def _artifacts() -> dict[str, str]:
    async with get_client() as client:
        return {a.key: a.type for a in await client.read_artifacts() if a.key}


def test_evaluate_flow_reports_and_caches(tmp_path, smollm2):
    torch.set_num_threads(1)
    store = LocalStore(tmp_path / "store")
    cfg = PipelineConfig(
        run="flow",
        store=StoreConfig(uri=store.root),
        evaluate=EvaluateConfig(
            num_steps=[2], max_new_tokens=6, mtbench_questions=2, heldout_samples=1, device="cpu"
        ),
    )
    upstream = Upstream(
        results={
            "merge": [corpus_result(store, "flow", smollm2, n=6)],
            "train": [train_result(store, "flow", smollm2, tmp_path)],
        }
    )
    (first,) = run_stage("evaluate", cfg, smollm2, upstream)
    assert not first.cache_hit and first.figures["prompts_mtbench"] == 2
    artifacts = asyncio.run(_artifacts())
    assert artifacts["flow-evaluate"] == "progress"
    assert artifacts["evaluate-report"] == "markdown"
    assert artifacts["evaluate-acceptance"] == "markdown"  # the PNG embedded as a data URI
    assert artifacts["evaluate-figures"] == "table"
    (again,) = run_stage("evaluate", cfg, smollm2, upstream)
    assert again.key == first.key and again.figures == first.figures
    assert again.cache_hit and again.original_seconds == first.seconds

    # A disabled deployment is a recorded no-op (no server is started).
    (skipped,) = run_stage(
        "deploy",
        cfg.model_copy(update={"deploy": DeployConfig(enabled=False)}),
        smollm2,
        upstream.plus("evaluate", [first]),
    )
    assert skipped.figures == {"deployed": False}
