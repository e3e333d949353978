"""`eagle3_pipeline`: the whole pipeline as one Prefect flow of stage subflows.

    generate-all (a subflow per dataset) -> merge -> extract -> train -> evaluate -> deploy

Each stage returns the URI of its manifest (a `StageResult`), never data; each is cached across runs
(see `flows.stagecache`), so re-running a finished pipeline costs seconds and changing a training
parameter re-runs only training and what follows. A failing stage fails the flow (subflow calls
raise), and the `on_failure`/`on_crashed` hooks post to the configured webhook.
"""

from __future__ import annotations

import contextlib
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from aerie.config import PipelineConfig, apply_overrides
from aerie.manifest import StageResult
from aerie.pipeline import (
    STAGES,
    PipelineReport,
    check_secrets,
    figure_text,
    generation_endpoint,
    generation_pending,
    shards_needed,
)
from aerie.presets import get_preset
from aerie.store import open_store
from aerie.targets import TargetConfig, TargetInfo, resolve_target
from flows.deploy import deploy_flow
from flows.evaluate import evaluate_flow
from flows.extract import extract_flow
from flows.generate import generate_all
from flows.merge import merge_corpus
from flows.reporting import artifact_key, notify_failure
from flows.train import train_flow


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
    name="eagle3-pipeline",
    on_failure=[notify_failure],
    on_crashed=[notify_failure],
    log_prints=True,
)
def eagle3_pipeline(
    preset: str | None = "smollm2-local",
    overrides: list[str] | None = None,
    config: PipelineConfig | None = None,
) -> list[StageResult]:
    """Generate -> merge -> extract -> train -> evaluate -> deploy, each stage a cached subflow."""
    cfg = pipeline_config(preset, overrides, config)
    store = open_store(cfg.store)
    check_secrets(cfg, store)
    target = resolve_target_task(cfg.target)
    store_cfg, run = cfg.store, cfg.run

    # The embedded default generates with the target itself: launch it only when a dataset needs it.
    launch = cfg.generate.endpoint.base_url is None and generation_pending(cfg, store)
    with generation_endpoint(cfg, target) if launch else contextlib.nullcontext(None) as base_url:
        generated = generate_all(cfg.generate, store_cfg, run, base_url)
    corpus = merge_corpus(cfg.corpus, store_cfg, run, target, generated)
    needed = shards_needed(cfg, STAGES, corpus, store=store, run_name=run, target=target)
    shards = extract_flow(cfg.extract, store_cfg, run, target, corpus, cfg.server, needed)
    drafter = train_flow(cfg.train, store_cfg, run, target, shards, corpus)
    evaluation = evaluate_flow(cfg.evaluate, store_cfg, run, target, drafter, corpus)
    results = [*generated, corpus, shards, drafter, evaluation]
    if cfg.deploy.enabled:
        results.append(deploy_flow(cfg.deploy, store_cfg, run, target, drafter, evaluation, cfg.server))
    _summarize(cfg, results)
    return results


def _summarize(cfg: PipelineConfig, results: list[StageResult]) -> None:
    report = PipelineReport(config=cfg, results=results, seconds=sum(r.seconds for r in results))
    # One line in the log, the table in the artifacts: `aerie run` prints the table itself, once.
    get_run_logger().info(
        "pipeline %s: %d stages in %.1f s; the summary is the artifact %s",
        cfg.run,
        len(results),
        report.seconds,
        artifact_key(cfg.run, "summary"),
    )
    rows: list[dict[str, Any]] = [
        {
            "stage": r.stage,
            "seconds": round(r.seconds, 1),
            "cache": "hit" if r.cache_hit else "run",
            "seconds when it ran": None if r.original_seconds is None else round(r.original_seconds, 1),
            "figures": ", ".join(f"{k}={figure_text(v)}" for k, v in r.figures.items()),
            "manifest": r.manifest_uri,
        }
        for r in results
    ]
    create_table_artifact(
        rows, key=artifact_key(cfg.run, "pipeline"), description=f"aerie pipeline {cfg.run}"
    )
    create_markdown_artifact(
        f"```\n{report.table()}\n```", key=artifact_key(cfg.run, "summary"), description="pipeline summary"
    )


def run_pipeline(cfg: PipelineConfig) -> str:
    """Run the flow locally (ephemeral Prefect API unless PREFECT_API_URL is set); return the summary."""
    results = eagle3_pipeline(preset=cfg.preset, config=cfg)
    report = PipelineReport(config=cfg, results=results, seconds=sum(r.seconds for r in results))
    return report.table()
