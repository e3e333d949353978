"""One Prefect subflow for every stage (generate, merge, extract, train, evaluate, deploy): the
library's stage (`aerie.stage`) as a task with its cache key, retries and artifacts, or, for a stage of
parts, its parts as subflows or runs of a deployment.

    stage_flow("train", cfg, target, upstream)   ->  its StageResults (pointers to their manifests)

A stage of one piece is a task cached across runs on the stage's own key plus the store and run
(`flows.stagecache`): the subflow is handed the key (the pipeline flow's) or works it out once
(`StageJob.key`), and hands it to the task, whose cache key and run take it as it is; when the
stage has work to do (`Stage.needs`: no manifest, or extraction's shards gone while the next stage reads
them) Prefect's cache is skipped and the library decides what is left to do.

A stage of parts (generation's datasets, extraction's slices: `Stage.parts`) runs through the library's
one fan-out (`aerie.stage.run_parts`): around the parts (generation's endpoint), each part still to do
as a subflow of its own (`stage_part_flow`, named by the policy: `generate-dataset`, `extract-slice`)
in threads of this flow, or as a run of the policy's deployment (`flows.fanout`), then the assembly. A
part finished by an earlier run is skipped before anything is launched.

Each stage's policy (`flows.<stage>.POLICY`, else `flows.policy.default_policy`) names its task,
retries (never for failures a retry cannot fix) and reports; the subflow adds a progress artifact, a
table of the figures, a table of the parts and the stage's reports.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.context import TaskRunContext
from pydantic import BaseModel

from aerie.config import PipelineConfig
from aerie.manifest import StageResult
from aerie.pipeline import STAGES
from aerie.progress import ProgressFn
from aerie.stage import PartsRunner, Stage, StageContext, StageJob, StagePart, Upstream, in_threads, run_parts
from aerie.store import StoreConfig, open_store
from aerie.targets import TargetInfo

from . import deploy, evaluate, extract, generate, merge, train
from .fanout import through_deployment
from .policy import StagePolicy, default_policy
from .reporting import artifact_key, prefect_progress, show_each_traceback_once, stage_table
from .retrying import retry_unless
from .stagecache import cache_key, run_cached

POLICIES: dict[str, StagePolicy] = {
    "generate": generate.POLICY,
    "merge": merge.POLICY,
    "extract": extract.POLICY,
    "train": train.POLICY,
    "evaluate": evaluate.POLICY,
    "deploy": deploy.POLICY,
}
_BY_NAME: dict[str, Stage] = {stage.name: stage for stage in STAGES}
show_each_traceback_once()


def policy_of(stage: str) -> StagePolicy:
    """The stage's policy (`flows.<stage>.POLICY`), or the default one for a stage without."""
    return POLICIES.get(stage) or default_policy(stage)


def _job(
    stage: str,
    cfg: PipelineConfig,
    target: TargetInfo,
    upstream: Upstream | None = None,
    rebuild_missing: bool = False,
) -> StageJob:
    """The stage's job in this flow, its progress going to Prefect progress artifacts."""
    title = policy_of(stage).title

    def progress(name: str) -> ProgressFn:
        return prefect_progress(artifact_key(cfg.run, name), title if name == stage else f"{title}, {name}")

    store = open_store(cfg.store)
    ctx = StageContext(store, cfg.run, target, progress=progress, rebuild_missing=rebuild_missing)
    return _BY_NAME[stage].job(cfg, ctx, upstream)


def _cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    cfg: PipelineConfig = parameters["cfg"]
    return cache_key(context.task.name, cfg.store.uri, cfg.run, parameters["key"])


@task(cache_key_fn=_cache_key, persist_result=True)
def stage_task(
    stage: str, cfg: PipelineConfig, target: TargetInfo, upstream: Upstream, rebuild_missing: bool, key: str
) -> StageResult:
    """Run the stage whose key (`key`, the subflow's) is known: the stage takes it as it is."""
    job = _job(stage, cfg, target, upstream, rebuild_missing)
    job.remember_key(key)
    (result,) = job.stage.run(job)
    return result


@task
def part_task(
    stage: str, cfg: PipelineConfig, target: TargetInfo, upstream: Upstream, part: StagePart, shared: Any
) -> BaseModel:
    """One part of a stage (`Stage.run_part`): a retry resumes from what the part left in the store."""
    job = _job(stage, cfg, target, upstream)
    return job.stage.run_part(job, part, shared)


@task(retries=2, retry_delay_seconds=5)
def report_task(stage: str, result: StageResult, store_cfg: StoreConfig) -> None:
    report = policy_of(stage).report
    if report is not None:
        report(result, open_store(store_cfg))


def _retrying(runner: Any, policy: StagePolicy, **options: Any) -> Any:
    return runner.with_options(
        name=policy.task,
        retries=policy.retries,
        retry_delay_seconds=policy.retry_delay_s,
        retry_condition_fn=retry_unless(*policy.not_retried),
        **options,
    )


@flow
def stage_part_flow(
    stage: str,
    cfg: PipelineConfig,
    target: TargetInfo,
    upstream: Upstream,
    part: StagePart,
    shared: Any = None,
) -> BaseModel:
    """One part of a stage on this host: a subflow of the stage's, or the run of a deployment that a
    stage's flow on another host started (`flows.fanout`). Returns the part's record."""
    return _retrying(part_task, policy_of(stage))(stage, cfg, target, upstream, part, shared)


# The entrypoint of the `extract-slice/*` deployments (prefect.yaml): one extraction slice on the host
# whose worker takes the run.
extract_slice_flow = stage_part_flow.with_options(name=extract.POLICY.part_flow)


@flow(flow_run_name="{stage}")
def stage_flow(
    stage: str,
    cfg: PipelineConfig,
    target: TargetInfo,
    upstream: Upstream | None = None,
    rebuild_missing: bool = False,
    key: str | None = None,
    parts: list[StagePart] | None = None,
) -> list[StageResult]:
    """Run one stage (or find it cached); returns its results. `key` and `parts`: the stage's key and
    parts where the caller has worked them out already (the pipeline flow's composer has), else they are
    worked out here."""
    policy = policy_of(stage)
    job = _job(stage, cfg, target, upstream, rebuild_missing)
    # Hashed at most once: `needs` and `parts` below find it in the job's context, the task and its
    # cache key are handed it.
    if key is None:
        key = job.key()
    else:
        job.remember_key(key)
    parts = job.stage.parts(job) if parts is None else parts
    if parts:
        results = run_parts(job, parts=parts, runner=_parts_runner(job, policy, parts))
    else:
        runner = _retrying(stage_task, policy, refresh_cache=job.stage.needs(job))
        results = [
            run_cached(
                runner,
                job.ctx.store,
                stage=stage,
                cfg=cfg,
                target=target,
                upstream=job.upstream,
                rebuild_missing=rebuild_missing,
                key=key,
            )
        ]
    for result in results:
        stage_table(result, policy.summary(result))
        if policy.report is not None:
            report_task.with_options(name=f"{stage}-report")(stage, result, cfg.store)
    return results


def _parts_runner(job: StageJob, policy: StagePolicy, parts: list[StagePart]) -> PartsRunner:
    """The parts as subflows in threads of this flow, or as runs of the policy's deployment; either
    way a table of the parts once they have ended."""
    stage, cfg = job.stage, job.cfg
    deployment = policy.part_deployment(cfg)
    if deployment:
        run = through_deployment(deployment, job)
    else:

        def one(part: StagePart, shared: Any) -> BaseModel:
            # Named here, not by a template: a deployment's run keeps the name its starter gave it.
            subflow = stage_part_flow.with_options(name=policy.part_flow, flow_run_name=part.name)
            return subflow(stage.name, cfg, job.ctx.target, job.upstream, part, shared)

        run = in_threads(job, one=one)

    def runner(todo: list[StagePart], shared: Any) -> list[BaseModel | BaseException]:
        outcomes = run(todo, shared)
        now = dict(zip((p.index for p in todo), outcomes, strict=True))
        rows = [policy.part_row(part, now.get(part.index)) for part in parts]
        failed = sum(isinstance(o, BaseException) for o in outcomes)
        create_table_artifact(
            rows,
            key=artifact_key(cfg.run, stage.name, policy.parts_table),
            description=f"{stage.name}: {len(parts) - failed} of {len(parts)} {policy.parts_table} complete",
        )
        return outcomes

    return runner


def run_stage(
    stage: str,
    cfg: PipelineConfig,
    target: TargetInfo,
    upstream: Upstream,
    rebuild_missing: bool = False,
    key: str | None = None,
    parts: list[StagePart] | None = None,
) -> list[StageResult]:
    """`stage_flow` under the stage's own name in the UI (`merge`, `train`, ...)."""
    named = stage_flow.with_options(name=stage)
    return named(stage, cfg, target, upstream, rebuild_missing, key, parts)
