"""`aerie_pipeline`: the whole pipeline as one Prefect flow of stage subflows.

    generate (a subflow per dataset) -> merge -> extract -> train -> evaluate -> deploy

The stages, their order and what each is fed are the library's (`aerie.pipeline.compose`); this flow
runs each through the one generic stage subflow (`flows.stage`): a stage of parts (generation's
datasets, extraction's slices) as a subflow per part, or a run per part of `extract.slice_deployment`. Each stage returns the URI of its manifest (a `StageResult`), never
data; each is cached across runs, so re-running a finished pipeline costs seconds and changing a
training parameter re-runs only training and what follows. A failing stage fails the flow (subflow
calls raise), and this flow's `on_failure`/`on_crashed` hook posts one alert to the configured webhook, naming the
run, the stage that failed and the first line of its error (the stage subflows post none).

On the flow run's page: a progress artifact (`<run>-progress`: the stage running, stages done of all),
and at the end the summary table (`<run>-summary`: the drafter's acceptance length against prompt
lookup's, the served speed-up, promoted or not), whose line is also the run log's last.
"""

from __future__ import annotations

from typing import Any, cast
from uuid import UUID

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.runtime import flow_run

from aerie.config import PipelineConfig, apply_overrides
from aerie.manifest import StageResult
from aerie.pipeline import PipelineReport, check_secrets, compose, figure_text, planned, resolve
from aerie.plan import track
from aerie.plan.render import table
from aerie.presets import get_preset
from aerie.stage import StageContext, StageJob
from aerie.store import open_store
from aerie.targets import TargetConfig, TargetInfo, resolve_target

from .headline import headline_rows, headline_text
from .reporting import artifact_key, notify_failure, running_stage
from .stage import run_stage


def pipeline_config(
    preset: str | None, overrides: list[str] | None, config: PipelineConfig | None
) -> PipelineConfig:
    """A full config, or a preset with `key=value` overrides (what deployments pass)."""
    cfg = config if config is not None else get_preset(preset or "smollm2-local")
    return apply_overrides(cfg, overrides) if overrides else cfg


@task(name="resolve-target", retries=1, retry_delay_seconds=10)
def resolve_target_task(cfg: TargetConfig) -> TargetInfo:
    """Resolve (and on first use convert) the target model."""
    return resolve_target(cfg)


@flow(
    name="aerie-pipeline",
    on_failure=[notify_failure],
    on_crashed=[notify_failure],
    log_prints=True,
)
def aerie_pipeline(
    preset: str | None = "smollm2-local",
    overrides: list[str] | None = None,
    config: PipelineConfig | None = None,
) -> list[StageResult]:
    """Generate -> merge -> extract -> train -> evaluate -> deploy, each stage a cached subflow."""
    cfg = pipeline_config(preset, overrides, config)
    store = open_store(cfg.store)
    check_secrets(cfg, store)
    ctx = StageContext(store=store, run=cfg.run, target=resolve_target_task(cfg.target))
    plan = track.plan_for(cfg)
    cfg = resolve(cfg, ctx.target, plan)
    if plan is not None:
        create_markdown_artifact(
            f"```\n{table(plan)}\n```", key=artifact_key(cfg.run, "plan"), description="plan"
        )

    names = [s.name for s in planned(cfg, None)]
    progress = cast(
        UUID, create_progress_artifact(0.0, key=artifact_key(cfg.run, "progress"), description="starting")
    )

    def step(job: StageJob) -> list[StageResult]:
        # Hashed at most once in this run (the composer's look-ahead, `aerie.pipeline.rebuild_missing`,
        # has mostly done it already): the subflow is handed the key and the parts rather than hashing
        # them again.
        stage, key = job.stage, job.key()
        parts = stage.parts(job)
        done = names.index(stage.name)
        update_progress_artifact(
            progress, 100.0 * done / len(names), f"{stage.name}: stage {done + 1} of {len(names)}"
        )
        with running_stage(flow_run.get_id(), stage.name):  # the failure alert names it
            return run_stage(
                stage.name, cfg, job.ctx.target, job.upstream, job.ctx.rebuild_missing, key, parts
            )

    results = compose(cfg, ctx, step, plan=plan)
    update_progress_artifact(progress, 100.0, f"{len(names)} of {len(names)} stages done")
    _summarize(cfg, results, track.gpu_seconds(plan, store, results))
    return results


def _summarize(cfg: PipelineConfig, results: list[StageResult], gpu_seconds: float | None) -> None:
    report = PipelineReport(
        config=cfg, results=results, seconds=sum(r.seconds for r in results), gpu_seconds=gpu_seconds
    )
    # The headline in the log's last line, the tables in the artifacts: `aerie run` prints the whole
    # summary itself, once.
    headline = headline_rows(results)
    if headline:
        create_table_artifact(
            headline, key=artifact_key(cfg.run, "summary"), description=f"aerie {cfg.run}: headline figures"
        )
    rows: list[dict[str, Any]] = [
        {
            "stage": r.stage,
            "seconds": round(r.seconds, 1),
            "cache": "hit" if r.cache_hit else "run",
            "seconds when it ran": None if r.original_seconds is None else round(r.original_seconds, 1),
            "estimate s": r.figures.get("estimate_s"),
            "figures": ", ".join(f"{k}={figure_text(v)}" for k, v in r.figures.items()),
            "manifest": r.manifest_uri,
        }
        for r in results
    ]
    create_table_artifact(
        rows, key=artifact_key(cfg.run, "pipeline"), description=f"aerie pipeline {cfg.run}"
    )
    create_markdown_artifact(
        f"```\n{report.table()}\n```", key=artifact_key(cfg.run, "stages"), description="every stage"
    )
    get_run_logger().info(
        "pipeline %s: %d stages in %.1f s; %s; tables: artifacts %s, %s",
        cfg.run,
        len(results),
        report.seconds,
        headline_text(results) or "no evaluation or deployment in this run",
        artifact_key(cfg.run, "summary"),
        artifact_key(cfg.run, "pipeline"),
    )


def run_pipeline(cfg: PipelineConfig) -> str:
    """Run the flow locally (ephemeral Prefect API unless PREFECT_API_URL is set); return the summary."""
    results = aerie_pipeline(preset=cfg.preset, config=cfg)
    gpu_seconds = track.gpu_seconds(track.plan_for(cfg), open_store(cfg.store), results)
    report = PipelineReport(
        config=cfg, results=results, seconds=sum(r.seconds for r in results), gpu_seconds=gpu_seconds
    )
    return report.table()
