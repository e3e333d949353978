"""Prefect flow of the evaluate stage: acceptance of the drafter beside prompt lookup, as tables and a plot.

Thin on purpose: `aerie.evaluate.stage.run` does the work. Its measurements are written one by one, so
the task's retry measures only what is missing; the task is cached across runs on the drafter and
corpus manifest digests and the evaluation config (`flows.stagecache`).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from aerie.evaluate import stage as evaluate_stage
from aerie.evaluate.config import EvaluateConfig
from aerie.evaluate.report import ACCEPTANCE_PNG
from aerie.manifest import StageResult
from aerie.store import StoreConfig, open_store
from aerie.targets import TargetInfo
from flows.reporting import artifact_key, image_artifact, notify_failure, prefect_progress, stage_table
from flows.stagecache import run_cached, stage_cache_key


@task(
    name="evaluate-drafter",
    cache_key_fn=stage_cache_key,
    persist_result=True,
    retries=1,
    retry_delay_seconds=10,
)
def evaluate_task(
    cfg: EvaluateConfig,
    store_cfg: StoreConfig,
    run_name: str,
    target: TargetInfo,
    drafter: StageResult,
    corpus: StageResult,
) -> StageResult:
    progress = prefect_progress(artifact_key(run_name, "evaluate"), "speculative decoding evaluation")
    return evaluate_stage.run(
        cfg,
        store=open_store(store_cfg),
        run_name=run_name,
        target=target,
        drafter=drafter,
        corpus=corpus,
        progress=progress,
    )


@task(name="evaluate-report", retries=2, retry_delay_seconds=5)
def report_task(result: StageResult, store_cfg: StoreConfig) -> None:
    """The report's tables as a markdown artifact and the acceptance-per-position plot as an image."""
    store = open_store(store_cfg)
    create_markdown_artifact(
        store.get_bytes(f"{result.prefix}/report.md").decode(),
        key=artifact_key(result.stage, "report"),
        description="acceptance length and per-position acceptance",
    )
    with tempfile.TemporaryDirectory() as tmp:
        local = store.get_file(f"{result.prefix}/{ACCEPTANCE_PNG}", Path(tmp) / ACCEPTANCE_PNG)
        image_artifact(local, key="evaluate-acceptance", description="acceptance per draft position")


@flow(name="evaluate", on_failure=[notify_failure], on_crashed=[notify_failure])
def evaluate_flow(
    cfg: EvaluateConfig,
    store_cfg: StoreConfig,
    run_name: str,
    target: TargetInfo,
    drafter: StageResult,
    corpus: StageResult,
) -> StageResult:
    """Measure the drafter's acceptance length (and prompt lookup's) on MT-Bench and held-out prompts."""
    store = open_store(store_cfg)
    result = run_cached(
        evaluate_task,
        store,
        cfg=cfg,
        store_cfg=store_cfg,
        run_name=run_name,
        target=target,
        drafter=drafter,
        corpus=corpus,
    )
    stage_table(result, "evaluate: acceptance length per dataset, proposer and draft steps")
    report_task(result, store_cfg)
    return result
