"""PNG plots of a training run from its metrics.jsonl records: loss and per-TTT-step accuracy, with the
held-out acceptance length both walked in rounds (what serving gets) and per position (runs high)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aerie.diskspace import writing
from aerie.errors import TrainingError

LOSS_PNG = "loss.png"
ACCURACY_PNG = "accuracy.png"


def plot_metrics(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write loss.png and accuracy.png into `out_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # no display on workers
    import matplotlib.pyplot as plt

    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    out_dir.mkdir(parents=True, exist_ok=True)

    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot([r["step"] for r in train], [r["window_loss"] for r in train], label="train (weighted)")
    if evals:
        weights = [sum(loss for loss in r["loss"]) for r in evals]
        ax.plot([r["step"] for r in evals], weights, "o-", label="eval (sum over steps)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("soft cross-entropy")
    ax.set_title("Drafter loss")
    ax.grid(alpha=0.3)
    ax.legend()
    loss_path = out_dir / LOSS_PNG
    fig.tight_layout()
    with writing(loss_path, TrainingError):
        fig.savefig(loss_path, dpi=110)
    plt.close(fig)

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = len(train[0]["step_acc"]) if train else len(evals[0]["acc"]) if evals else 0
    for k in range(steps):
        if train:
            left.plot([r["step"] for r in train], [r["step_acc"][k] for r in train], label=f"step {k}")
        if evals:
            right.plot([r["step"] for r in evals], [r["cond_acc"][k] for r in evals], "o-", label=f"step {k}")
    left.set_title("train accuracy per TTT step")
    right.set_title("eval conditional accuracy per TTT step")
    for ax in (left, right):
        ax.set_xlabel("optimizer step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    if steps:
        left.legend(fontsize=7)
    if evals:
        twin = right.twinx()
        walked = [r for r in evals if "accept_length_rounds" in r]  # not in records of older runs
        twin.plot(
            [r["step"] for r in walked],
            [r["accept_length_rounds"] for r in walked],
            "k-",
            label="accept length (rounds)",
        )
        twin.plot(
            [r["step"] for r in evals],
            [r["accept_length"] for r in evals],
            "k:",
            label="accept length (per position)",
        )
        twin.set_ylabel("held-out acceptance length")
        twin.legend(loc="lower right", fontsize=7)
    acc_path = out_dir / ACCURACY_PNG
    fig.tight_layout()
    with writing(acc_path, TrainingError):
        fig.savefig(acc_path, dpi=110)
    plt.close(fig)
    return [loss_path, acc_path]
