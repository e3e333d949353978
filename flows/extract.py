"""The extraction stage under Prefect, and its fan-out over hosts.

On one host `aerie.extract` does the work through the generic stage subflow (`flows.stage`, with
`POLICY`): the disk preflight runs first inside the stage, so a shortage fails in seconds, before any
server starts, and is not retried; the task owns the servers (it launches, restarts and always tears
them down itself) and its retry resumes from the shards already uploaded (`progress.json`).

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

from aerie.config import PipelineConfig
from aerie.errors import ConfigError, ExtractionError, PreflightError
from aerie.extract import slices
from aerie.extract.config import ExtractConfig
from aerie.extract.plan import extract_key
from aerie.extract.preflight import human_bytes
from aerie.extract.stage import EXTRACT
from aerie.manifest import StageDir, StageResult
from aerie.serving.config import ServerConfig
from aerie.stage import StageContext, Upstream, WorkContext
from aerie.store import StoreConfig, open_store
from aerie.targets import TargetInfo

from .policy import StagePolicy
from .reporting import artifact_key, notify_failure, prefect_progress, stage_table
from .retrying import retry_unless


def _summary(result: StageResult) -> str:
    f = result.figures
    return (
        f"extract: {f.get('tokens', 0):,} tokens in {f.get('shards', 0)} shards "
        f"({f.get('storage_dtype')}, {human_bytes(f.get('bytes', 0))})"
    )


POLICY = StagePolicy(
    task="extract-hidden-states",
    title="hidden-state extraction",
    summary=_summary,
    retries=1,
    retry_delay_s=30,
    # A dead server or a store hiccup may pass in 30 s; a disk shortage or a bad config does not.
    not_retried=(PreflightError, ConfigError),
)
SLICE_POLL_S = 5.0  # how often the parent looks at its slice runs


# ---- one slice per host, and the fan-out over a deployment of it ------------------------------------


@task(name="extract-slice-target", retries=1, retry_delay_seconds=10)
def slice_target_task(target: TargetInfo) -> TargetInfo:
    """The target as this host has it (resolved again by name when the path is not here)."""
    return slices.local_target(target)


_worth_retrying = retry_unless(*POLICY.not_retried)


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
    key: str,
) -> slices.SliceRecord:
    """One slice; its retry resumes from the slice's own progress object."""
    progress = prefect_progress(
        artifact_key(run_name, "extract-slice", str(slice_index)),
        f"hidden-state extraction, slice {slice_index} of {cfg.num_slices}",
    )
    ctx = WorkContext(out=_stage_dir(store_cfg, run_name, key), target=target, progress=progress)
    return slices.run_slice(cfg, slice_index, ctx, corpus=corpus, server=server)


def _stage_dir(store_cfg: StoreConfig, run_name: str, key: str) -> StageDir:
    return StageDir(open_store(store_cfg), run_name, EXTRACT.name, key)


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
    key: str | None = None,
) -> slices.SliceRecord:
    """Slice `slice_index` of `num_slices` (default: cfg's) on this host, into the shared store: the
    entrypoint of the `extract-slice/*` deployments. A finished slice returns its record at once.
    `key`: the extraction's key, as the parent worked it out (else it is worked out here)."""
    if num_slices is not None:
        cfg = cfg.model_copy(update={"num_slices": num_slices})
    if key is None:
        key = extract_key(cfg, server, target, corpus)
    record = extract_slice_task(
        cfg, store_cfg, run_name, slice_target_task(target), corpus, server, slice_index, key
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
    key: str,
) -> StageResult:
    ctx = WorkContext(out=_stage_dir(store_cfg, run_name, key), target=target)
    return slices.assemble(cfg, ctx, corpus=corpus, server=server)


@flow(name="extract", on_failure=[notify_failure], on_crashed=[notify_failure])
def extract_flow(
    cfg: PipelineConfig,
    target: TargetInfo,
    upstream: Upstream,
    rebuild_missing: bool = False,
    key: str | None = None,
) -> StageResult:
    """Run every unfinished slice through `extract.slice_deployment` at once, wait, then assemble. With
    `rebuild_missing`, the slices that lost shards count as unfinished (`slices.forget_missing`).
    `key`: the extraction's key where the caller has worked it out (else it is worked out here); the
    slices and the assembly are handed it."""
    if key is None:
        ctx = StageContext(store=open_store(cfg.store), run=cfg.run, target=target)
        key = EXTRACT.remembered_key(cfg, ctx, upstream)
    stage = _stage_dir(cfg.store, cfg.run, key)
    extract = cfg.extract
    n = extract.num_slices
    if rebuild_missing and (missing := slices.forget_missing(stage, n)):
        get_run_logger().warning("extraction: %d shards are gone; their slices run again", len(missing))
    params: dict[str, Any] = {
        "cfg": extract,
        "store_cfg": cfg.store,
        "run_name": cfg.run,
        "target": target,
        "corpus": upstream.corpus,
        "server": cfg.server,
        "key": key,
    }
    result = stage.cached_result() or _run_slices(extract, stage, params)
    stage_table(result, _summary(result))
    return result


def _run_slices(cfg: ExtractConfig, stage: StageDir, params: dict[str, Any]) -> StageResult:
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
