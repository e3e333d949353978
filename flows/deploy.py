"""Prefect flow of the deploy stage: the speculative server against the baseline, and the promotion.

Thin on purpose: `aerie.evaluate.deploy.deploy` launches the servers through `aerie.serving` (readiness,
nonce, teardown) and benchmarks them. No retry: a benchmark re-run on a flaky host would mix
conditions; a failed deploy is re-run as a whole, and a finished one is a cache hit.
"""

from __future__ import annotations

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact

from aerie.evaluate import deploy as deploy_stage
from aerie.evaluate.config import DeployConfig
from aerie.manifest import StageResult
from aerie.serving import ServerConfig
from aerie.store import StoreConfig, open_store
from aerie.targets import TargetInfo
from flows.reporting import artifact_key, notify_failure, prefect_progress, stage_table
from flows.stagecache import run_cached, stage_cache_key


@task(name="deploy-benchmark", cache_key_fn=stage_cache_key, persist_result=True)
def deploy_task(
    cfg: DeployConfig,
    store_cfg: StoreConfig,
    run_name: str,
    target: TargetInfo,
    drafter: StageResult,
    evaluation: StageResult,
    server: ServerConfig,
) -> StageResult:
    progress = prefect_progress(artifact_key(run_name, "deploy"), "deployment benchmark")
    return deploy_stage.deploy(
        cfg,
        store=open_store(store_cfg),
        run_name=run_name,
        target=target,
        drafter=drafter,
        evaluation=evaluation,
        server=server,
        progress=progress,
    )


@flow(name="deploy", on_failure=[notify_failure], on_crashed=[notify_failure])
def deploy_flow(
    cfg: DeployConfig,
    store_cfg: StoreConfig,
    run_name: str,
    target: TargetInfo,
    drafter: StageResult,
    evaluation: StageResult,
    server: ServerConfig,
) -> StageResult:
    """Benchmark the drafter served with speculative decoding; promote it if it beats the baseline."""
    store = open_store(store_cfg)
    result = run_cached(
        deploy_task,
        store,
        cfg=cfg,
        store_cfg=store_cfg,
        run_name=run_name,
        target=target,
        drafter=drafter,
        evaluation=evaluation,
        server=server,
    )
    promoted = result.figures.get("promoted")
    stage_table(result, f"deploy: speed-up {result.figures.get('speedup')}, promoted: {promoted}")
    key = f"{result.prefix}/report.md"
    if store.exists(key):
        create_markdown_artifact(
            store.get_bytes(key).decode(),
            key=artifact_key("deploy", "report"),
            description="serving benchmark",
        )
    return result
