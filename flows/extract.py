"""Prefect flow of the extraction stage: preflight -> (launch + readiness -> canary -> extract ->
teardown, always) -> summary.

Thin on purpose: the library's `aerie.extract.stage` does the work. The preflight is its own task so
a disk shortage fails in seconds, visibly, before any server starts. The extraction task owns the
servers (it launches, restarts and always tears them down itself); its retry resumes from the shards
already uploaded (`progress.json`). Both are cached across runs on the corpus manifest digest and the
configs (`flows.stagecache`), and the library's own manifest makes a re-run a hit even without Prefect.

Fan-out over hosts: with `extract.slice_deployment` set (e.g. "extract-slice/gpu", prefect.yaml),
`extract_flow` starts one `extract_slice_flow` run per unfinished slice of `extract.num_slices` through
that deployment (`run_deployment`, linked as subflows, all at once), waits for all of them, fails
naming any slice whose run did not complete, and assembles the stage from the slice records
(`aerie.extract.slices`). Each slice host runs its own preflight; the parent runs none.
"""

from __future__ import annotations

import time
from typing import Any, cast
from uuid import UUID

from prefect import flow, get_run_logger, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from pydantic import BaseModel

from aerie.errors import ConfigError, ExtractionError, PreflightError
from aerie.extract import slices
from aerie.extract import stage as extract_stage
from aerie.extract.config import ExtractConfig
from aerie.extract.preflight import human_bytes
from aerie.manifest import StageResult
from aerie.serving.config import ServerConfig
from aerie.store import ArtifactStore, StoreConfig, open_store
from aerie.targets import TargetInfo
from flows.reporting import artifact_key, notify_failure, prefect_progress, stage_table
from flows.retrying import retry_unless
from flows.stagecache import run_cached, stage_cache_key

SLICE_POLL_S = 5.0  # how often the parent looks at its slice runs


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
    if extract_stage.stage_dir(cfg, store, run_name, target, corpus, server).manifest() is not None:
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
    rebuild_missing: bool = False,
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
        rebuild_missing=rebuild_missing,
    )


@flow(name="extract", on_failure=[notify_failure], on_crashed=[notify_failure])
def extract_flow(
    cfg: ExtractConfig,
    store_cfg: StoreConfig,
    run_name: str,
    target: TargetInfo,
    corpus: StageResult,
    server: ServerConfig,
    rebuild_missing: bool = False,
) -> StageResult:
    """Extract the corpus's hidden states into shards; returns the stage result (a pointer). With
    `rebuild_missing` (the run needs the shards, `aerie.pipeline.shards_needed`) a finished extraction
    whose shards are gone makes them again: the task skips Prefect's cache and the library checks the
    store."""
    store = open_store(store_cfg)
    params: dict[str, Any] = {
        "cfg": cfg,
        "store_cfg": store_cfg,
        "run_name": run_name,
        "target": target,
        "corpus": corpus,
        "server": server,
    }
    if cfg.slice_deployment:
        result = _fan_out(cfg, store, params, rebuild_missing)
    else:
        report = preflight_task(**params)
        need = sum(fs["need"] for fs in report["filesystems"])
        get_run_logger().info(
            "extraction preflight: %s tokens, %s needed on disk", f"{report['tokens']:,}", human_bytes(need)
        )
        stage_task = extract_task.with_options(refresh_cache=True) if rebuild_missing else extract_task
        result = run_cached(stage_task, store, **params, rebuild_missing=rebuild_missing)
    figures = result.figures
    stage_table(
        result,
        f"extract: {figures.get('tokens', 0):,} tokens in {figures.get('shards', 0)} shards "
        f"({figures.get('storage_dtype')}, {human_bytes(figures.get('bytes', 0))})",
    )
    return result


# ---- one slice per host, and the fan-out over a deployment of it ------------------------------------


@task(name="extract-slice-target", retries=1, retry_delay_seconds=10)
def slice_target_task(target: TargetInfo) -> TargetInfo:
    """The target as this host has it (resolved again by name when the path is not here)."""
    return slices.local_target(target)


# A dead server or a store hiccup may pass in 30 s; a disk shortage or a bad config does not.
_worth_retrying = retry_unless(PreflightError, ConfigError)


@task(
    name="extract-slice-hidden-states",
    retries=1,
    retry_delay_seconds=30,
    retry_condition_fn=_worth_retrying,
)
def extract_slice_task(
    cfg: ExtractConfig,
    store_cfg: StoreConfig,
    run_name: str,
    target: TargetInfo,
    corpus: StageResult,
    server: ServerConfig,
    slice_index: int,
) -> slices.SliceRecord:
    """One slice; its retry resumes from the slice's own progress object."""
    progress = prefect_progress(
        artifact_key(run_name, "extract-slice", str(slice_index)),
        f"hidden-state extraction, slice {slice_index} of {cfg.num_slices}",
    )
    return slices.run_slice(
        cfg,
        slice_index,
        store=open_store(store_cfg),
        run_name=run_name,
        target=target,
        corpus=corpus,
        server=server,
        progress=progress,
    )


@flow(name="extract-slice", on_failure=[notify_failure], on_crashed=[notify_failure])
def extract_slice_flow(
    cfg: ExtractConfig,
    store_cfg: StoreConfig,
    run_name: str,
    target: TargetInfo,
    corpus: StageResult,
    server: ServerConfig,
    slice_index: int,
    num_slices: int | None = None,
) -> slices.SliceRecord:
    """Slice `slice_index` of `num_slices` (default: cfg's) on this host, into the shared store: the
    entrypoint of the `extract-slice/*` deployments. A finished slice returns its record at once."""
    if num_slices is not None:
        cfg = cfg.model_copy(update={"num_slices": num_slices})
    record = extract_slice_task(
        cfg, store_cfg, run_name, slice_target_task(target), corpus, server, slice_index
    )
    get_run_logger().info(
        "slice %d of %d on %s: %s tokens in %d shards (%s extracted by this run)",
        record.slice,
        record.num_slices,
        record.host,
        f"{sum(s['tokens'] for s in record.shards):,}",
        len(record.shards),
        f"{record.tokens:,}",
    )
    return record


@task(name="extract-assemble")
def assemble_task(
    cfg: ExtractConfig,
    store_cfg: StoreConfig,
    run_name: str,
    target: TargetInfo,
    corpus: StageResult,
    server: ServerConfig,
) -> StageResult:
    return slices.assemble(
        cfg, store=open_store(store_cfg), run_name=run_name, target=target, corpus=corpus, server=server
    )


def _fan_out(
    cfg: ExtractConfig, store: ArtifactStore, params: dict[str, Any], rebuild_missing: bool
) -> StageResult:
    """Run every unfinished slice through `cfg.slice_deployment` at once, wait, then assemble. With
    `rebuild_missing`, the slices that lost shards count as unfinished (`slices.forget_missing`)."""
    stage = extract_stage.stage_dir(
        cfg, store, params["run_name"], params["target"], params["corpus"], params["server"]
    )
    if rebuild_missing and (missing := slices.forget_missing(stage, cfg.num_slices)):
        get_run_logger().warning("extraction: %d shards are gone; their slices run again", len(missing))
    cached = stage.cached_result()
    if cached is not None:
        return cached
    n = cfg.num_slices
    pending = [k for k in range(n) if slices.read_record(stage, k, n) is None]
    logger = get_run_logger()
    logger.info(
        "extraction fan-out: %d of %d slices to run through %s", len(pending), n, cfg.slice_deployment
    )
    runs = {k: _start_slice(cfg, params, k) for k in pending}
    failed = [
        f"slice {k} of {n} (flow run {run.name!r}, {run.id}): {_state_line(run)}"
        for k, run in _wait(runs).items()
        if run.state is None or not run.state.is_completed()
    ]
    if failed:
        raise ExtractionError(
            f"extraction slices through {cfg.slice_deployment} did not complete: {'; '.join(failed)}; "
            "finished slices are kept, a re-run runs only the others"
        )
    return assemble_task(**params)


def _start_slice(cfg: ExtractConfig, params: dict[str, Any], k: int) -> FlowRun:
    """Create slice k's flow run (a subflow of this one) and return without waiting for it."""
    parameters = {
        name: value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        for name, value in params.items()
    }
    parameters.update(slice_index=k, num_slices=cfg.num_slices)
    try:
        run = run_deployment(
            str(cfg.slice_deployment),
            parameters=parameters,
            flow_run_name=f"{params['run_name']}-slice-{k}-of-{cfg.num_slices}",
            timeout=0,
        )
    except ObjectNotFound as exc:
        raise ConfigError(
            f"extract.slice_deployment={cfg.slice_deployment!r} is not a deployment on this Prefect server "
            "(prefect --no-prompt deploy --name <name>, see prefect.yaml)"
        ) from exc
    return cast(FlowRun, run)  # called from a sync flow, run_deployment runs synchronously


def _wait(runs: dict[int, FlowRun]) -> dict[int, FlowRun]:
    """Poll the slice runs until every one is in a final state."""
    pending: dict[int, UUID] = {k: run.id for k, run in runs.items()}
    done: dict[int, FlowRun] = {}
    logger = get_run_logger()
    with get_client(sync_client=True) as client:
        while pending:
            for k, run_id in list(pending.items()):
                run = client.read_flow_run(run_id)
                if run.state is not None and run.state.is_final():
                    done[k] = run
                    del pending[k]
                    logger.info("slice %d: flow run %s is %s", k, run.name, _state_line(run))
            if pending:
                time.sleep(SLICE_POLL_S)
    return done


def _state_line(run: FlowRun) -> str:
    if run.state is None:
        return "no state"
    message = (run.state.message or "").splitlines()
    return f"{run.state.type.value}" + (f": {message[0]}" if message else "")
