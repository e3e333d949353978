"""Prefect flow of the train stage: train (or resume) the drafter -> figures, per-step metrics, plots.

Thin on purpose: `aerie.train.stage.run` does the work — in this process on one device, or as torchrun
workers when `num_gpus > 1`. The training task's retry resumes from the newest checkpoint in the store,
so a crash costs at most `checkpoint_every` steps. The task is cached across runs on the extract and
corpus manifest digests and the training config (`flows.stagecache`); the stage's own manifest makes a
re-run a hit even without Prefect.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_table_artifact

from aerie.manifest import StageResult, load_manifest
from aerie.store import StoreConfig, open_store
from aerie.targets import TargetInfo
from aerie.train import stage as train_stage
from aerie.train.config import TrainConfig
from flows.reporting import artifact_key, image_artifact, notify_failure, prefect_progress, stage_table
from flows.stagecache import run_cached, stage_cache_key


@task(
    name="train-drafter",
    cache_key_fn=stage_cache_key,
    persist_result=True,
    retries=1,
    retry_delay_seconds=30,
)
def train_task(
    cfg: TrainConfig,
    store_cfg: StoreConfig,
    run_name: str,
    target: TargetInfo,
    shards: StageResult,
    corpus: StageResult,
) -> StageResult:
    progress = prefect_progress(artifact_key(run_name, "train"), "drafter training")
    return train_stage.run(
        cfg,
        store=open_store(store_cfg),
        run_name=run_name,
        target=target,
        shards=shards,
        corpus=corpus,
        progress=progress,
    )


@task(name="train-report", retries=2, retry_delay_seconds=5)
def report_task(result: StageResult, store_cfg: StoreConfig) -> None:
    """Per-TTT-step metrics of the final evaluation as a table; the loss and accuracy plots as images."""
    store = open_store(store_cfg)
    manifest = load_manifest(store, result.prefix)
    final = manifest.get("final", {})
    create_table_artifact(
        step_rows(final.get("eval") or {}, final.get("step_loss") or []),
        key=artifact_key(result.stage, "steps"),
        description=f"drafter per TTT step at step {final.get('step')} (eval = held-out, full-vocab argmax)",
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in manifest["files"]["plots"]:
            local = store.get_file(f"{result.prefix}/{name}", Path(tmp) / name)
            image_artifact(local, key=f"train-{Path(name).stem}", description=f"drafter {Path(name).stem}")


def step_rows(evaluation: dict[str, Any], train_loss: list[float]) -> list[dict[str, Any]]:
    """One row per TTT step: train loss, eval loss, accuracy and conditional accuracy."""
    steps = max(len(train_loss), len(evaluation.get("acc", [])))
    rows = []
    for k in range(steps):
        rows.append(
            {
                "ttt step": k,
                "train loss": _at(train_loss, k),
                "eval loss": _at(evaluation.get("loss", []), k),
                "eval acc": _at(evaluation.get("acc", []), k),
                "eval cond acc": _at(evaluation.get("cond_acc", []), k),
            }
        )
    return rows


def _at(values: list[Any], k: int) -> Any:
    return values[k] if k < len(values) else None


@flow(name="train", on_failure=[notify_failure], on_crashed=[notify_failure])
def train_flow(
    cfg: TrainConfig,
    store_cfg: StoreConfig,
    run_name: str,
    target: TargetInfo,
    shards: StageResult,
    corpus: StageResult,
) -> StageResult:
    """Train the EAGLE-3 drafter on the extracted shards; returns the stage result (a pointer)."""
    store = open_store(store_cfg)
    result = run_cached(
        train_task,
        store,
        cfg=cfg,
        store_cfg=store_cfg,
        run_name=run_name,
        target=target,
        shards=shards,
        corpus=corpus,
    )
    f = result.figures
    stage_table(
        result,
        f"train: best step {f.get('best_step')} of {f.get('steps')}, held-out acceptance length "
        f"{f.get('accept_length_rounds')} in rounds ({f.get('accept_length')} per position), "
        f"vocab coverage {f.get('vocab_coverage')}",
    )
    report_task(result, store_cfg)
    return result
