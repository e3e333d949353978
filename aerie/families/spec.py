"""What a drafter family declares (`Family`), its settings' base (`DrafterSettings`) and its lazily
imported parts (`Part`).

The declaration is light on purpose: the config, the planner and the CLI read it without importing
torch or any stage, and a part's module is imported only when a stage uses it (`Part.load`). The
parts' types are the protocols of `aerie.families.protocols`, so a wrong signature is a type error and
this package imports nothing above it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, cast

from aerie.configbase import StrictModel
from aerie.families.protocols import Diagnosis, Exporter, Loader, TrainSettings

if TYPE_CHECKING:
    from torch import nn

    from aerie.families.protocols import FamilyProposer, Objective
    from aerie.targets import TargetGeometry


T = TypeVar("T")


class DrafterSettings(StrictModel):
    """A family's own settings, the section `train.drafter`: `family` names the family, the rest are
    its fields (`aerie.families.<name>`)."""

    family: str

    def vocab_rows(self, target_vocab: int) -> int:
        """Rows of the drafter's head for a target of `target_vocab` tokens: the target's whole
        vocabulary unless the family drafts over a smaller one (`Family.vocabulary` "draft")."""
        return target_vocab

    def check_training(self, train: TrainSettings) -> None:
        """Refuse (ValueError, naming the keys) shared training settings this family cannot train with."""


@dataclass(frozen=True)
class Part(Generic[T]):
    """A part of a family named `module:attribute`, imported when first used."""

    ref: str

    def load(self) -> T:
        module, _, attr = self.ref.partition(":")
        return cast(T, getattr(importlib.import_module(module), attr))


@dataclass(frozen=True)
class Family:
    """One drafter family: everything that differs between families, so nothing else branches on a
    family's name.

    - `config`: its settings (`train.drafter`, tagged by `family`);
    - `capture_layers(settings, num_layers)`: the target layers it reads, output-of-layer ids (what
      extraction captures); None for a family that reads only the target's last hidden state;
    - `vocabulary`: "draft", a draft vocabulary of its settings' `vocab_rows` tokens mapped to the
      target's (d2t/t2d), or "target", the target's whole vocabulary;
    - `served_algorithm`: SGLang's `--speculative-algorithm` for its export; `deployable`: whether the
      deploy stage serves it (checked when the config loads);
    - `draft_params(settings, train, geometry)`: trainable parameters for a target of that geometry,
      the planner's sizes; `train_flops(settings, train, geometry, seq_len)`: forward+backward FLOPs per
      trained token of a `seq_len` row, the planner's training time (None: 6 x its parameters, a dense
      forward and backward over each token);
    - `diagnosis`: the evaluator's teacher-forced diagnosis of its drafter (`aerie.evaluate.diagnose` for
      EAGLE-3; None: no diagnosis), a part like the others;
    - the parts: its model class, its objective (its part of the training loop), export and loader, and
      the proposer the lossless evaluator drafts with.
    """

    name: str
    config: type[DrafterSettings]
    capture_layers: Callable[[Any, int], list[int]] | None
    vocabulary: Literal["draft", "target"]
    served_algorithm: str
    deployable: bool
    draft_params: Callable[[Any, TrainSettings, TargetGeometry], int]
    model: Part[type[nn.Module]]
    objective: Part[Callable[[Any], Objective[Any, Any, Any]]]
    export: Part[Exporter]
    loader: Part[Loader]
    proposer: Part[Callable[[Any], FamilyProposer]]
    diagnosis: Part[Diagnosis] | None = None
    train_flops: Callable[[Any, TrainSettings, TargetGeometry, int], float] | None = None

    def flops_per_token(
        self, settings: DrafterSettings, train: TrainSettings, geometry: TargetGeometry, seq_len: int
    ) -> float:
        """Forward+backward FLOPs per trained token (`train_flops`, or 6 x its parameters)."""
        if self.train_flops is not None:
            return self.train_flops(settings, train, geometry, seq_len)
        return 6.0 * self.draft_params(settings, train, geometry)

    @property
    def diagnosed(self) -> bool:
        """Whether the evaluator diagnoses its drafter (keeps its greedy answers for `diagnosis`)."""
        return self.diagnosis is not None

    def layers(self, settings: DrafterSettings, num_layers: int) -> list[int]:
        """The output-of-layer ids it reads of a `num_layers` target ([] when it reads none)."""
        return [] if self.capture_layers is None else self.capture_layers(settings, num_layers)
