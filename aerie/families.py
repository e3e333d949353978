"""Drafter families: what differs between EAGLE-3 and the DFlash block drafter, in one table.

A family names
- the target layers it captures (output-of-layer convention, as SGLang's drafter configs write them),
- its draft model, its part of the training loop (model, teacher, loss, held-out walk), its export (the
  directory SGLang loads) and the loader reading it back, and its proposer for the lossless evaluator,
  each as a `module:attribute` reference.

The references are resolved only when used (`Family.load`), so this module imports nothing of aerie's
stages: training, evaluation and the benchmarks all read the table without an import circle, and the
draft model never learns about training. A new family (DSpark) is one more module per part and one
more entry in `FAMILIES`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aerie.errors import ConfigError


def eagle3_layers(num_layers: int, count: int = 3) -> list[int]:
    """EAGLE-3's low, middle and high layers: outputs of 1, N//2-1 and N-4 (inputs of 2, N//2, N-3)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def spread_layers(num_layers: int, count: int) -> list[int]:
    """`count` layers evenly spaced from the output of layer 1 to that of layer N-3, DFlash's choice
    (its Qwen3-8B drafter reads [1, 9, 17, 25, 33] of 36). One layer is the middle one."""
    if count == 1:
        return [num_layers // 2]
    first, last = 1, num_layers - 3
    if last < first or count > last - first + 1:
        raise ConfigError(
            f"cannot spread {count} capture layers over a {num_layers}-layer target (outputs 1..{last})"
        )
    # Half-up rounding of the evenly spaced points, so the choice does not depend on float parity.
    return [first + int((2 * i * (last - first) + count - 1) // (2 * (count - 1))) for i in range(count)]


@dataclass(frozen=True)
class Family:
    """One drafter family. The part fields are `module:attribute` references (see `load`)."""

    name: str
    layers: Callable[[int, int], list[int]]  # (target layers, count) -> output-of-layer ids
    sglang_algorithm: str
    model: str  # the draft module
    objective: str  # its part of the training loop (`aerie.train.loop.Objective`)
    export: str  # (drafter, out_dir, target, provenance) -> the directory SGLang loads
    loader: str  # (dir, target, device, dtype) -> the drafter, read back
    proposer: str  # (drafter) -> the lossless evaluator's proposer

    def load(self, part: str) -> Any:
        """The object a part names: `family.load("proposer")` imports its module and returns it."""
        ref = getattr(self, part)
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)


def _family(
    name: str,
    layers: Callable[[int, int], list[int]],
    algorithm: str,
    *,
    model: str,
    objective: str,
    files: str,
    proposer: str,
) -> Family:
    """An entry; `files` = "module:stem" names the pair `export_<stem>` / `load_<stem>` of that module."""
    module, _, stem = files.partition(":")
    return Family(
        name, layers, algorithm, model=model, objective=objective,
        export=f"{module}:export_{stem}", loader=f"{module}:load_{stem}", proposer=proposer,
    )  # fmt: skip


FAMILIES: dict[str, Family] = {
    "eagle3": _family(
        "eagle3",
        eagle3_layers,
        "EAGLE3",
        model="aerie.draft.model:Eagle3Drafter",
        objective="aerie.train.objective:Eagle3Objective",
        files="aerie.draft.export:drafter",
        proposer="aerie.engine.speculative.eagle:EagleProposer",
    ),  # fmt: skip
    "dflash": _family(
        "dflash",
        spread_layers,
        "DFLASH",
        model="aerie.draft.dflash:DFlashDrafter",
        objective="aerie.train.dflash_objective:DFlashObjective",
        files="aerie.draft.dflash_export:dflash",
        proposer="aerie.engine.speculative.dflash:DFlashProposer",
    ),  # fmt: skip
}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConfigError(f"unknown drafter family {name!r}; allowed: {', '.join(FAMILIES)}") from None
