"""Prefect flow of the extraction stage: preflight -> (launch + readiness -> canary -> extract ->
teardown, always) -> summary.

Thin on purpose: the library's `aerie.extract.stage` does the work. The preflight is its own task so
a disk shortage fails in seconds, visibly, before any server starts. The extraction task owns the
servers (it launches, restarts and always tears them down itself); its retry resumes from the shards
already uploaded (`progress.json`). Both are cached across runs on the corpus manifest digest and the
configs (`flows.stagecache`), and the library's own manifest makes a re-run a hit even without Prefect.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task

from aerie.extract import stage as extract_stage
from aerie.extract.config import ExtractConfig
from aerie.extract.preflight import human_bytes
from aerie.manifest import StageDir, StageResult
from aerie.serving.config import ServerConfig
from aerie.store import StoreConfig, open_store
from aerie.targets import TargetInfo
from flows.reporting import artifact_key, notify_failure, prefect_progress, stage_table
from flows.stagecache import run_cached, stage_cache_key


@task(name="extract-preflight")
def preflight_task(
    cfg: ExtractConfig,
    store_cfg: StoreConfig,
    run_name: str,
    target: TargetInfo,
    corpus: StageResult,
    server: ServerConfig,
) -> dict[str, Any]:
    """Corpus token counts and free disk; raises PreflightError (never retried) when short. Nothing to
    check when the stage already completed."""
    store = open_store(store_cfg)
    key = extract_stage.extract_key(cfg, server, target, corpus)
    if StageDir(store, run_name, extract_stage.STAGE, key).manifest() is not None:
        return {"cached": True, "tokens": 0, "filesystems": []}
    plan = extract_stage.plan(
        cfg, store=store, run_name=run_name, target=target, corpus=corpus, server=server
    )
    return plan.preflight.record()


@task(
    name="extract-hidden-states",
    cache_key_fn=stage_cache_key,
    persist_result=True,
    retries=1,
    retry_delay_seconds=30,
)
def extract_task(
    cfg: ExtractConfig,
    store_cfg: StoreConfig,
    run_name: str,
    target: TargetInfo,
    corpus: StageResult,
    server: ServerConfig,
) -> StageResult:
    progress = prefect_progress(artifact_key(run_name, "extract"), "hidden-state extraction")
    return extract_stage.run(
        cfg,
        store=open_store(store_cfg),
        run_name=run_name,
        target=target,
        corpus=corpus,
        server=server,
        progress=progress,
    )


@flow(name="extract", on_failure=[notify_failure], on_crashed=[notify_failure])
def extract_flow(
    cfg: ExtractConfig,
    store_cfg: StoreConfig,
    run_name: str,
    target: TargetInfo,
    corpus: StageResult,
    server: ServerConfig,
) -> StageResult:
    """Extract the corpus's hidden states into shards; returns the stage result (a pointer)."""
    store = open_store(store_cfg)
    params: dict[str, Any] = {
        "cfg": cfg,
        "store_cfg": store_cfg,
        "run_name": run_name,
        "target": target,
        "corpus": corpus,
        "server": server,
    }
    report = preflight_task(**params)
    need = sum(fs["need"] for fs in report["filesystems"])
    get_run_logger().info(
        "extraction preflight: %s tokens, %s needed on disk", f"{report['tokens']:,}", human_bytes(need)
    )
    result = run_cached(extract_task, store, **params)
    figures = result.figures
    stage_table(
        result,
        f"extract: {figures.get('tokens', 0):,} tokens in {figures.get('shards', 0)} shards "
        f"({figures.get('storage_dtype')}, {human_bytes(figures.get('bytes', 0))})",
    )
    return result
