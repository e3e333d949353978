"""A toy drafter family written as `docs/extending.md` says: its own settings, parts and declaration.

Its drafter holds no weights; its proposer drafts the last token again `k` times (a real proposer the
lossless decoder verifies: a run of repeated tokens is accepted, anything else rejected). Its export
writes the `aerie.json` a loader reads back, so the reference server can serve it in another process,
where it arrives as a plug-in (the entry point `TOY_ENTRY_POINT` names it)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import pydantic
from torch import Tensor

from aerie.errors import TargetError
from aerie.families import DrafterSettings, Family, Part, spread_layers
from aerie.families.protocols import TrainSettings
from aerie.targets import TargetGeometry, TargetInfo

TOY_ENTRY_POINT = "toy = tests.toy_family:TOY"


class ToySettings(DrafterSettings):
    """The toy's own settings: `train.drafter.family=toy`, `train.drafter.num_target_layers=2`."""

    family: Literal["toy"] = "toy"
    num_target_layers: int = pydantic.Field(2, ge=1)


class ToyDrafter:
    """The toy's model: holds nothing (the recipe's parts are the family's own modules)."""


def export_toy(
    drafter: ToyDrafter, out_dir: str | Path, target: TargetInfo, provenance: dict[str, Any] | None = None
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "aerie.json").write_text(
        json.dumps({"family": "toy", "target": target.name, **(provenance or {})})
    )
    return out


def load_toy(path: str | Path, target: TargetInfo, device: Any = "cpu", dtype: Any = None) -> ToyDrafter:
    provenance = json.loads((Path(path) / "aerie.json").read_text())
    if provenance.get("family") != "toy":
        raise TargetError(f"{path} holds a {provenance.get('family')} drafter, not a toy one")
    return ToyDrafter()


class ToyProposer:
    """Drafts the sequence's last token `k` times."""

    name = "toy"
    needs_aux = False
    aux_layers = None

    def __init__(self, drafter: ToyDrafter) -> None:
        self.drafter = drafter
        self.last: dict[int, int] = {}

    def add(self, seqs: Sequence[int], contexts: Sequence[list[int]], aux: Sequence[Tensor] | None) -> None:
        self.last.update((s, c[-1]) for s, c in zip(seqs, contexts, strict=True))

    def propose(self, seqs: Sequence[int], k: int) -> list[list[int]]:
        return [[self.last[s]] * k for s in seqs]

    def advance(
        self, seqs: Sequence[int], new_tokens: Sequence[list[int]], aux: Sequence[Tensor] | None
    ) -> None:
        self.last.update((s, t[-1]) for s, t in zip(seqs, new_tokens, strict=True) if t)

    def remove(self, seqs: Sequence[int]) -> None:
        for s in seqs:
            self.last.pop(s, None)


def toy_params(settings: ToySettings, train: TrainSettings, geometry: TargetGeometry) -> int:
    return settings.num_target_layers * geometry.hidden_size**2


TOY = Family(
    name="toy",
    config=ToySettings,
    capture_layers=lambda settings, num_layers: spread_layers(num_layers, settings.num_target_layers),
    vocabulary="target",
    served_algorithm="TOY",
    deployable=False,
    draft_params=toy_params,
    model=Part("tests.toy_family:ToyDrafter"),
    objective=Part("tests.toy_family:ToyDrafter"),
    export=Part("tests.toy_family:export_toy"),
    loader=Part("tests.toy_family:load_toy"),
    proposer=Part("tests.toy_family:ToyProposer"),
)
