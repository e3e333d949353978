"""Checkpoints that resume exactly: weights, optimizer, scheduler, RNG, data position and best-so-far.

A checkpoint is a directory written to a temp name and renamed, so a half-written one never exists:

    step-00000500/model.safetensors   trainable weights + d2t/t2d in training precision (fp32)
    step-00000500/optimizer.pt        AdamW state
    step-00000500/trainer.pt          TrainState, scheduler, RNG states, run and drafter config
    step-00000500/trainer.json        the same facts, readable

The data position is the step itself: the epoch plans are a pure function of the training seed (see data.py).
The stage uploads finished directories to the store and points `checkpoints/latest.json` at the newest.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from aerie.diskspace import writing
from aerie.errors import TrainingError

MODEL = "model.safetensors"
OPTIMIZER = "optimizer.pt"
TRAINER = "trainer.pt"
SUMMARY = "trainer.json"
FILES = (MODEL, OPTIMIZER, TRAINER, SUMMARY)


@dataclass
class TrainState:
    """What the loop carries from step to step (besides the model and optimizer)."""

    step: int = 0
    tokens: int = 0
    best_accept_length_rounds: float = -1.0  # the held-out figure the best drafter is kept by
    best_step: int = -1
    # Wall seconds spent reaching `step`, summed over every run that contributed (each run's start-up
    # included; steps redone after a resume count in the run that redid them): a training that spans
    # several budgeted runs reports its whole time, not the last run's.
    elapsed_s: float = 0.0
    runs: int = 1


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_weights(model: torch.nn.Module, path: Path) -> None:
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    with writing(path, TrainingError):
        save_file(state, str(path))


def save_checkpoint(
    root: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: TrainState,
    config: dict[str, Any],
) -> Path:
    """Write `root/step-XXXXXXXX/` atomically; returns it."""
    final = root / checkpoint_name(state.step)
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with writing(final, TrainingError):
        tmp.mkdir(parents=True)
        save_weights(model, tmp / MODEL)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER)
        torch.save(
            {
                "state": asdict(state),
                "scheduler": scheduler.state_dict(),
                "rng": rng_state(),
                "config": config,
            },
            tmp / TRAINER,
        )
        summary = json.dumps({"state": asdict(state), "config": config}, indent=2, default=str)
        (tmp / SUMMARY).write_text(summary)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    return final


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> TrainState:
    """Restore everything `save_checkpoint` wrote; the model and optimizer must already be on their device."""
    try:
        weights = load_file(str(path / MODEL), device=str(next(model.parameters()).device))
        model.load_state_dict(weights, strict=True)
        optimizer.load_state_dict(torch.load(path / OPTIMIZER, map_location="cpu", weights_only=True))
        trainer = torch.load(path / TRAINER, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, KeyError) as exc:
        raise TrainingError(f"checkpoint {path} cannot be restored: {exc}") from exc
    scheduler.load_state_dict(trainer["scheduler"])
    set_rng_state(trainer["rng"])
    state = dict(trainer["state"])
    # Checkpoints from before the round-walk figure kept the best by the per-position estimate, which is
    # not comparable: the resumed run re-finds its best.
    if state.pop("best_accept_length", None) is not None:
        state["best_step"] = -1
    return TrainState(**state)
