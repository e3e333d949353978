"""What a drafter family declares (`Family`), its settings' base (`DrafterSettings`) and its lazily
imported parts (`Part`).

The declaration is light on purpose: the config, the planner and the CLI read it without importing
torch or any stage, and a part's module is imported only when a stage uses it (`Part.load`). The
parts' types are the protocols of the packages that call them, so a wrong signature is a type error.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar, cast

from aerie.configbase import StrictModel

if TYPE_CHECKING:
    import torch
    from torch import nn

    from aerie.engine.speculative.decoder import Proposer
    from aerie.targets import TargetGeometry, TargetInfo
    from aerie.train.config import TrainConfig
    from aerie.train.loop import Objective

    class FamilyProposer(Proposer, Protocol):
        """A family's proposer: it also says which target hidden states it reads."""

        @property
        def aux_layers(self) -> list[int] | None: ...


T = TypeVar("T")


class DrafterSettings(StrictModel):
    """A family's own settings, the section `train.drafter`: `family` names the family, the rest are
    its fields (`aerie.families.<name>`)."""

    family: str


class Exporter(Protocol):
    def __call__(
        self, drafter: Any, out_dir: str | Path, target: TargetInfo, provenance: dict[str, Any] | None = None
    ) -> Path:
        """Write the directory a server loads; returns it."""
        ...


class Loader(Protocol):
    def __call__(
        self, path: str | Path, target: TargetInfo, device: str | torch.device = ..., dtype: torch.dtype = ...
    ) -> Any:
        """The drafter an export wrote, read back."""
        ...


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
    - `vocabulary`: "draft", a draft vocabulary of `train.draft_vocab_size` tokens mapped to the
      target's (d2t/t2d), or "target", the target's whole vocabulary;
    - `served_algorithm`: SGLang's `--speculative-algorithm` for its export; `deployable`: whether the
      deploy stage serves it (checked when the config loads);
    - `draft_params(settings, train, geometry)`: trainable parameters for a target of that geometry,
      the planner's FLOPs and sizes;
    - `diagnosed`: whether the evaluator's teacher-forced diagnosis (`aerie.evaluate.diagnose`) reads it;
    - the parts: its model class, its objective (its part of the training loop), export and loader, and
      the proposer the lossless evaluator drafts with.
    """

    name: str
    config: type[DrafterSettings]
    capture_layers: Callable[[Any, int], list[int]] | None
    vocabulary: Literal["draft", "target"]
    served_algorithm: str
    deployable: bool
    draft_params: Callable[[Any, TrainConfig, TargetGeometry], int]
    model: Part[type[nn.Module]]
    objective: Part[Callable[[TrainConfig], Objective]]
    export: Part[Exporter]
    loader: Part[Loader]
    proposer: Part[Callable[[Any], FamilyProposer]]
    diagnosed: bool = False

    def layers(self, settings: DrafterSettings, num_layers: int) -> list[int]:
        """The output-of-layer ids it reads of a `num_layers` target ([] when it reads none)."""
        return [] if self.capture_layers is None else self.capture_layers(settings, num_layers)
