"""The merge flow under a real Prefect test server: it returns the stage result, publishes the figures,
per-split/source and dropped-reason tables, the length histogram as an image, and a progress artifact;
a second call is a cache hit. A schema error fails the flow without a task retry."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

from aerie.config import PipelineConfig
from aerie.corpus.config import CorpusConfig
from aerie.errors import SchemaError
from aerie.manifest import StageResult
from aerie.stage import Upstream
from aerie.store import LocalStore, StoreConfig
from aerie.targets import TargetInfo
from flows.stage import run_stage
from tests.corpus_support import generated_result, msg

pytest_plugins = ("tests.prefect_support",)
# integration: a Prefect test server (one harness for every flow module)
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_harness")]


async def _artifacts() -> dict[str, str]:
    async with get_client() as client:
        return {a.key: a.type or "" for a in await client.read_artifacts() if a.key}


async def _task_runs(name: str) -> list[int]:
    async with get_client() as client:
        runs = await client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=name)))
        return [r.run_count for r in runs]


def merge_corpus(
    cfg: CorpusConfig, store_cfg: StoreConfig, run: str, target: TargetInfo, inputs: list[StageResult]
) -> StageResult:
    pipeline = PipelineConfig(run=run, store=store_cfg, corpus=cfg)
    (result,) = run_stage("merge", pipeline, target, Upstream().plus("generate", inputs))
    return result


def test_merge_flow_reports_and_caches(tmp_path: Path, smollm2):
    store_cfg = StoreConfig(uri=str(tmp_path / "store"))
    store = LocalStore(store_cfg.uri)
    rows = [
        {"id": f"c{i}", "source": "gen", "messages": [msg("user", f"q{i}"), msg("assistant", f"a{i}")]}
        for i in range(12)
    ] + [{"id": "bad", "source": "gen", "messages": [msg("assistant", "first")]}]
    up = generated_result(store, "flow", "gen", rows)
    cfg = CorpusConfig(num_workers=1, eval_fraction=0.25)

    result = merge_corpus(cfg, store_cfg, "flow", smollm2, [up])
    assert result.stage == "merge" and not result.cache_hit
    assert result.figures["records"] == 12 and result.figures["dropped"] == 1
    artifacts = asyncio.run(_artifacts())
    assert artifacts.get("merge-figures") == "table"
    assert artifacts.get("merge-splits") == "table"
    assert artifacts.get("merge-dropped") == "table"
    assert artifacts.get("merge-length-hist") == "markdown"
    assert artifacts.get("flow-merge") == "progress"

    again = merge_corpus(cfg, store_cfg, "flow", smollm2, [up])
    assert again.manifest_sha256 == result.manifest_sha256


def test_schema_error_fails_without_retry(tmp_path: Path, smollm2):
    import polars as pl

    store_cfg = StoreConfig(uri=str(tmp_path / "store"))
    store = LocalStore(store_cfg.uri)
    bad = generated_result(store, "broken", "gen", [], frame=pl.DataFrame({"id": ["x"], "source": ["s"]}))
    with pytest.raises(SchemaError, match="column 'messages' is missing"):
        merge_corpus(CorpusConfig(num_workers=1), store_cfg, "broken", smollm2, [bad])
    assert max(asyncio.run(_task_runs("merge-corpus"))) == 1
