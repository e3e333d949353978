"""One Prefect subflow for every stage of one result (merge, extract on one host, train, evaluate,
deploy): the library's stage (`aerie.stage`) as a task with its cache key, retries and artifacts.

    stage_flow("train", cfg, target, upstream)   ->  the StageResult (a pointer to its manifest)

The task is cached across runs on the stage's own key plus the store and run (`flows.stagecache`): the
subflow is handed the key (the pipeline flow's) or works it out once (`Stage.remembered_key`), and hands
it to the task, whose cache key and run take it as it is;
when the stage has work to do (`Stage.needs`: no manifest, or extraction's shards gone while the next
stage reads them) Prefect's cache is skipped and the library decides what is left to do. Each stage's
policy (`flows.<stage>.POLICY`, else `flows.policy.default_policy`) names its task, retries (never for
failures a retry cannot fix) and reports; the subflow adds a progress artifact, a table of the figures and the stage's reports.
Generation and the extraction's fan-out over hosts keep their own modules (`flows.generate`,
`flows.extract`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from prefect import flow, task
from prefect.context import TaskRunContext

from aerie.config import PipelineConfig
from aerie.manifest import StageResult
from aerie.pipeline import STAGES
from aerie.progress import ProgressFn
from aerie.stage import Stage, StageContext, Upstream
from aerie.store import StoreConfig, open_store
from aerie.targets import TargetInfo

from . import deploy, evaluate, extract, merge, train
from .policy import StagePolicy, default_policy
from .reporting import artifact_key, notify_failure, prefect_progress, stage_table
from .retrying import retry_unless
from .stagecache import cache_key, run_cached

POLICIES: dict[str, StagePolicy] = {
    "merge": merge.POLICY,
    "extract": extract.POLICY,
    "train": train.POLICY,
    "evaluate": evaluate.POLICY,
    "deploy": deploy.POLICY,
}
_BY_NAME: dict[str, Stage] = {stage.name: stage for stage in STAGES}


def policy_of(stage: str) -> StagePolicy:
    """The stage's policy (`flows.<stage>.POLICY`), or the default one for a stage without."""
    return POLICIES.get(stage) or default_policy(stage)


def _context(cfg: PipelineConfig, target: TargetInfo, rebuild_missing: bool = False) -> StageContext:
    return StageContext(
        store=open_store(cfg.store), run=cfg.run, target=target, rebuild_missing=rebuild_missing
    )


def _cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    cfg: PipelineConfig = parameters["cfg"]
    return cache_key(context.task.name, cfg.store.uri, cfg.run, parameters["key"])


@task(cache_key_fn=_cache_key, persist_result=True)
def stage_task(
    stage: str, cfg: PipelineConfig, target: TargetInfo, upstream: Upstream, rebuild_missing: bool, key: str
) -> StageResult:
    """Run the stage whose key (`key`, the subflow's) is known: the stage takes it as it is."""
    title = policy_of(stage).title

    def progress(name: str) -> ProgressFn:
        return prefect_progress(artifact_key(cfg.run, name), title)

    ctx = replace(_context(cfg, target, rebuild_missing), progress=progress)
    _BY_NAME[stage].remember_key(cfg, ctx, upstream, key)
    (result,) = _BY_NAME[stage].run(cfg, ctx, upstream)
    return result


@task(retries=2, retry_delay_seconds=5)
def report_task(stage: str, result: StageResult, store_cfg: StoreConfig) -> None:
    report = policy_of(stage).report
    if report is not None:
        report(result, open_store(store_cfg))


@flow(flow_run_name="{stage}", on_failure=[notify_failure], on_crashed=[notify_failure])
def stage_flow(
    stage: str,
    cfg: PipelineConfig,
    target: TargetInfo,
    upstream: Upstream | None = None,
    rebuild_missing: bool = False,
    key: str | None = None,
) -> StageResult:
    """Run one stage (or find it cached); returns its result. `key`: the stage's key where the caller
    has worked it out already (the pipeline flow's composer has), else it is worked out here."""
    policy, upstream = policy_of(stage), upstream or Upstream()
    ctx = _context(cfg, target, rebuild_missing)
    # Hashed at most once: `needs` below finds it in `ctx`, the task and its cache key are handed it.
    if key is None:
        key = _BY_NAME[stage].remembered_key(cfg, ctx, upstream)
    else:
        _BY_NAME[stage].remember_key(cfg, ctx, upstream, key)
    runner = stage_task.with_options(
        name=policy.task,
        retries=policy.retries,
        retry_delay_seconds=policy.retry_delay_s,
        retry_condition_fn=retry_unless(*policy.not_retried),
        refresh_cache=_BY_NAME[stage].needs(cfg, ctx, upstream),
    )
    result = run_cached(
        runner,
        ctx.store,
        stage=stage,
        cfg=cfg,
        target=target,
        upstream=upstream,
        rebuild_missing=rebuild_missing,
        key=key,
    )
    stage_table(result, policy.summary(result))
    if policy.report is not None:
        report_task.with_options(name=f"{stage}-report")(stage, result, cfg.store)
    return result


def run_stage(
    stage: str,
    cfg: PipelineConfig,
    target: TargetInfo,
    upstream: Upstream,
    rebuild_missing: bool = False,
    key: str | None = None,
) -> StageResult:
    """`stage_flow` under the stage's own name in the UI (`merge`, `train`, ...)."""
    named = stage_flow.with_options(name=stage)
    return named(stage, cfg, target, upstream, rebuild_missing, key)
