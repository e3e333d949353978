"""Estimates beside actuals: what the composer logs before each stage and records after it (in the
stage's manifest under `plan`, in its figures for the summary and the Prefect artifacts), and the
run's GPU time over every call. A plan is advice: a run never fails for want of one."""

from __future__ import annotations

import json
import logging
from typing import Any

from aerie.config import PipelineConfig
from aerie.errors import AerieError
from aerie.manifest import MANIFEST, StageResult, load_manifest
from aerie.plan.plan import Plan, make_plan, with_corpus
from aerie.plan.render import duration
from aerie.store import ArtifactStore

log = logging.getLogger("aerie.plan")

WARN_RATIO = 2.0  # an actual above this multiple of its estimate warns


def plan_for(cfg: PipelineConfig) -> Plan | None:
    try:
        plan = make_plan(cfg)
        if plan.machine is not None and plan.machine.far:
            log.warning("this machine: %s", plan.machine.line())
    except Exception as exc:  # noqa: BLE001 -- any failure to plan leaves the run as it was
        log.warning("no plan for run %s (%s): its stages run without estimates", cfg.run, exc)
        return None
    return plan


def refined(plan: Plan | None, stage: str, results: list[StageResult]) -> Plan | None:
    """After the merge stage, the plan from the corpus it made (its sizes were a sample's estimate)."""
    if plan is None or stage != "merge" or len(results) != 1:
        return plan
    try:
        return with_corpus(plan, results[0].figures)
    except Exception as exc:  # noqa: BLE001 -- a plan is advice: a run never fails for want of one
        log.warning("the plan keeps its corpus estimate (cannot read the corpus figures: %r)", exc)
        return plan


def before(plan: Plan | None, stage: str) -> None:
    est = plan.stage(stage) if plan else None
    if est is not None:
        log.info(
            "%s: estimated %s, %s of GPU time (%s)",
            stage,
            duration(est.seconds),
            duration(est.gpu_seconds),
            est.formula,
        )


def after(
    plan: Plan | None, store: ArtifactStore, stage: str, results: list[StageResult]
) -> list[StageResult]:
    """The results with their estimate among the figures; a stage that ran gets it in its manifest too,
    beside its seconds, and warns when it took more than WARN_RATIO times as long."""
    est = plan.stage(stage) if plan else None
    if est is None:
        return results
    ran = [r for r in results if not r.cache_hit]
    actual = sum(r.seconds for r in ran)
    if ran and actual > WARN_RATIO * est.seconds:
        log.warning(
            "%s took %s, more than %gx its estimate of %s (%s)",
            stage,
            duration(actual),
            WARN_RATIO,
            duration(est.seconds),
            est.formula,
        )
    for r in ran:
        key = f"{r.prefix}/{MANIFEST}"
        manifest = load_manifest(store, r.prefix)
        # `plan` is left out of the manifest's digest (aerie.manifest), so downstream keys stay as they were.
        manifest["plan"] = {
            "estimate_s": round(est.seconds, 1),
            "actual_s": round(actual, 1),
            "model": est.formula,
        }
        store.put_bytes(key, json.dumps(manifest, indent=2, default=str).encode())
    return [
        r.model_copy(update={"figures": {**r.figures, "estimate_s": round(est.seconds, 1)}}) for r in results
    ]


def spent_seconds(store: ArtifactStore, result: StageResult) -> float:
    """The seconds a stage's output cost over every call that worked on it: a cache hit's when it ran,
    and for a resumed generation or training the sum its manifest keeps over its runs."""
    seconds = (
        result.original_seconds
        if result.cache_hit and result.original_seconds is not None
        else result.seconds
    )
    try:
        manifest = load_manifest(store, result.prefix)
    except AerieError:
        return seconds
    return manifest_seconds(manifest, seconds)


def manifest_seconds(manifest: dict[str, Any], seconds: float) -> float:
    """`seconds`, or the sum over runs the manifest keeps (a resumed generation's or training's) if larger."""
    summed = (
        manifest.get("throughput", {}).get("wall_seconds")
        or manifest.get("training", {}).get("wall_s")
        or 0.0
    )
    return max(seconds, float(summed))


def gpu_seconds(plan: Plan | None, store: ArtifactStore, results: list[StageResult]) -> float | None:
    """GPU-seconds over every call: each stage's spent seconds times the GPUs the plan gives it."""
    if plan is None:
        return None
    total = 0.0
    for r in results:
        est = plan.stage("generate" if r.stage.startswith("generate-") else r.stage)
        if est is not None and est.gpus:
            total += spent_seconds(store, r) * est.gpus
    return total
