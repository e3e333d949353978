"""The train stage under Prefect: train (or resume) the drafter -> figures, per-step metrics, plots.

`aerie.train` does the work, through the generic stage subflow (`flows.stage`): in the task's process
on one device, or as torchrun workers when `num_gpus > 1`. A retry resumes from the newest checkpoint
in the store, so a crash costs at most `checkpoint_every` steps. An online training (`train.source:
online`) runs its own extraction servers: their launches, canaries and restarts are lines of the stage's
progress artifact while it runs, and the `train-servers` table says how each one ended.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.artifacts import create_table_artifact

from aerie.manifest import StageResult, load_manifest
from aerie.store import ArtifactStore
from aerie.workdirs import work_dir

from .policy import StagePolicy
from .reporting import artifact_key, image_artifact


def report(result: StageResult, store: ArtifactStore) -> None:
    """Per-TTT-step metrics of the final evaluation as a table; the loss and accuracy plots as images."""
    manifest = load_manifest(store, result.prefix)
    final = manifest.get("final", {})
    create_table_artifact(
        step_rows(final.get("eval") or {}, final.get("step_loss") or []),
        key=artifact_key(result.stage, "steps"),
        description=f"drafter per TTT step at step {final.get('step')} (eval = held-out, full-vocab argmax)",
    )
    if "online" in manifest:
        create_table_artifact(
            server_rows(manifest["online"]),
            key=artifact_key(result.stage, "servers"),
            description="online training: the extraction servers that fed the trainer, as each ended",
        )
    with work_dir("aerie-report-") as tmp:
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


def server_rows(online: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per server of every trainer rank: where it ran, how it ended, what it served."""
    return [
        {
            "rank": rank.get("rank", 0),
            "server": server["server"],
            "backend": server.get("backend"),
            "address": server.get("address"),
            "state": server.get("state"),
            "starts": server["starts"],
            "restarts": server["restarts"],
            "requests": server["requests"],
            "tokens": server["tokens"],
            "last error": (server.get("errors") or [None])[-1],
        }
        for rank in online.get("ranks", [])
        for server in rank.get("servers", [])
    ]


def _at(values: list[Any], k: int) -> Any:
    return values[k] if k < len(values) else None


def _summary(result: StageResult) -> str:
    f = result.figures
    online = (
        f", online from {f.get('servers')} server(s) ({f.get('server_restarts')} restart(s))"
        if f.get("source") == "online"
        else ""
    )
    return (
        f"train: best step {f.get('best_step')} of {f.get('steps')}, held-out acceptance length "
        f"{f.get('accept_length_rounds')} in rounds ({f.get('accept_length')} per position), "
        f"vocab coverage {f.get('vocab_coverage')}{online}"
    )


POLICY = StagePolicy(
    task="train-drafter",
    title="drafter training",
    summary=_summary,
    retries=1,
    retry_delay_s=30,
    report=report,
)
