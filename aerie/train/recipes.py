"""Named training recipes: a published way to train a drafter, written as the `key=value` settings aerie
takes (a recipe's `overrides` given to `aerie run PRESET ...` train it; `benchmarks/quality/train_sweep.py
--recipe NAME` trains several on one extraction).

A recipe changes only how the drafter trains (family, learning rate and schedule, batch, epochs, loss),
never the data, so recipes compared on one corpus read the same shards. Where a setting depends on the
data's size (epochs, the batch in samples) the recipe keeps the source's value; a sweep at another
size overrides it after the recipe and says so in its record.

- `eagle3_converged`: the EAGLE-3 recipe the newer trainers converged on (DeepSpec's Qwen3-8B config):
  lr 6e-4 after 4% warm-up, a global batch of 512 samples, 10 epochs, samples up to 4096 tokens, TTT 7
  with step decay 0.8, every sample weighing the same in the loss (one sample per device and step there),
  the best step chosen by held-out acceptance (aerie always does: `aerie.train.loop`).
- `dflash_authors`: DFlash as its authors and the peers train it (DeepSpec's DFlash config, SpecForge's
  recipe): 5 draft layers over 5 target layers, blocks of 16, 512 anchors per sample, loss decay 7, lr 6e-4
  after 4% warm-up, clip 1.0, 512 samples a step, 10 epochs, 4096 tokens; a row of 4096 tokens (one
  longest sample, as one sample per device there), since 512 anchors in each document of a 32K-token row
  make more blocks than one attention holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from aerie.errors import ConfigError


@dataclass(frozen=True)
class Recipe:
    """A recipe: its name, what it is, where it comes from and its settings."""

    name: str
    summary: str
    source: str
    overrides: tuple[str, ...]


CONVERGED_SCHEDULE = (
    "train.lr=6e-4",
    "train.warmup_ratio=0.04",
    "train.batch_sequences=512",
    "train.epochs=10",
    "train.max_length=4096",
    "train.loss_normalization=sequence",
)

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "eagle3_converged",
            "EAGLE-3, lr 6e-4 after 4% warm-up, 512 samples a step, 10 epochs, per-sample loss",
            "DeepSpec config/eagle3/eagle3_qwen3_8b.py",
            (
                "train.drafter=eagle3",
                *CONVERGED_SCHEDULE,
                "train.drafter.ttt_length=7",
                "train.drafter.step_decay=0.8",
            ),
        ),
        Recipe(
            "dflash_authors",
            "DFlash, 5 layers, blocks of 16, 512 anchors, loss decay 7, lr 6e-4, 512 samples a step",
            "DeepSpec config/dflash/dflash_qwen3_8b.py; SpecForge's DFlash recipe (block 16, gamma 7)",
            (
                "train.drafter=dflash",
                "train.drafter.num_layers=5",
                "train.drafter.num_target_layers=5",
                "train.drafter.block_size=16",
                "train.drafter.anchors_per_sequence=512",
                "train.drafter.loss_decay=7",
                *CONVERGED_SCHEDULE,
                "train.grad_clip=1.0",
                "train.batch_tokens=4096",
                # The deploy stage serves EAGLE-3 only; the config refuses DFlash with it on.
                "deploy.enabled=false",
            ),
        ),
    )
}


def recipe(name: str) -> Recipe:
    """The recipe called `name`."""
    try:
        return RECIPES[name]
    except KeyError:
        raise ConfigError(f"unknown training recipe {name!r}; known: {', '.join(RECIPES)}") from None
