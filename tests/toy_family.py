"""A toy drafter family written as `docs/extending.md` says: its own settings, parts and declaration.

Its drafter is one weight, the logit that the next answer token repeats the one before it, trained by
its objective through aerie's own training loop (`ToyObjective`: a real loss, metrics and held-out walk
over packed rows). Its proposer drafts the last token again `k` times (a real proposer the lossless
decoder verifies: a run of repeated tokens is accepted, anything else rejected). Its export writes the
`config.json`, `model.safetensors` (what every drafter directory holds) and `aerie.json` a loader reads back, so the reference server can serve it in another
process, where it arrives as a plug-in (the entry point `TOY_ENTRY_POINT` names it)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pydantic
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from aerie.errors import TargetError
from aerie.families import DrafterSettings, Family, Part, spread_layers
from aerie.families.protocols import TrainSettings
from aerie.targets import TargetGeometry, TargetInfo
from aerie.train.data import Batch
from aerie.train.teaching import walk_answers

TOY_ENTRY_POINT = "toy = tests.toy_family:TOY"


class ToySettings(DrafterSettings):
    """The toy's own settings: `train.drafter.family=toy`, `train.drafter.num_target_layers=2`."""

    family: Literal["toy"] = "toy"
    num_target_layers: int = pydantic.Field(2, ge=1)


@dataclass
class ToyConfig:
    repeat_logit: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"architectures": ["ToyDrafter"], "repeat_logit": self.repeat_logit}


class ToyDrafter(nn.Module):
    """The toy's model: one weight, the logit that an answer token repeats the token before it."""

    def __init__(self, config: ToyConfig | None = None) -> None:
        super().__init__()
        self.config = config or ToyConfig()
        self.repeat_logit = nn.Parameter(torch.tensor(self.config.repeat_logit))


class ToyTeacher:
    """The toy needs no target head: the packed row's own next tokens teach it."""

    def to(self, device: Any, dtype: Any) -> ToyTeacher:
        return self


def _repeats(batch: Batch) -> tuple[Tensor, Tensor]:
    """(valid [T-2], repeat [T-2]): row t's draft names x_{t+2} (the trainers' alignment); it is
    supervised when x_{t+2} is an answer token of the same document, right when it repeats x_{t+1}."""
    ids, doc = batch.input_ids, batch.doc_ids
    valid = batch.loss_mask[2:] & (doc[2:] == doc[1:-1]) & (doc[2:] == doc[:-2]) & (doc[2:] >= 0)
    return valid, ids[2:] == ids[1:-1]


class ToyObjective:
    """The toy's part of the training loop (`aerie.families.protocols.Objective`): a logistic loss of its
    one weight against whether each supervised token repeats the one before it."""

    width = 1  # one drafted token a round is scored

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def drafter(
        self, target: TargetInfo, draft_vocab_size: int, dtype: torch.dtype = torch.float32
    ) -> ToyDrafter:
        return ToyDrafter()

    def build(
        self, target: TargetInfo, vocab: dict[str, Tensor], dtype: torch.dtype
    ) -> tuple[ToyDrafter, ToyTeacher]:
        return ToyDrafter(), ToyTeacher()

    def loss(
        self, tr: Any, model: nn.Module, batch: Batch, reduce: Any, *, step: int = 0
    ) -> tuple[Tensor, Tensor]:
        valid, repeat = _repeats(batch)
        logit = model.repeat_logit.expand(int(valid.sum()))
        target = repeat[valid].float()
        losses = F.binary_cross_entropy_with_logits(logit, target, reduction="none")
        count = valid.sum().clamp(min=1)
        stats = torch.zeros(5, 1, device=logit.device)
        right = ((logit > 0) == repeat[valid]).sum()
        stats[:, 0] = torch.stack(
            [losses.sum().detach(), valid.sum(), right, repeat[valid].sum(), valid.sum()]
        ).float()
        return losses.sum() / count, stats

    def evaluate(self, tr: Any, batch: Batch) -> tuple[Tensor, tuple[int, int]]:
        with torch.no_grad():
            stats = self.loss(tr, tr.drafter, batch, lambda x: x)[1]
        valid, repeat = _repeats(batch)
        return stats, walk_answers(batch, [valid & repeat])

    def window_loss(self, summary: dict[str, float | list[float]]) -> float:
        losses = summary["loss"]
        assert isinstance(losses, list)
        return float(losses[0])


def export_toy(
    drafter: ToyDrafter, out_dir: str | Path, target: TargetInfo, provenance: dict[str, Any] | None = None
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(drafter.config.to_dict()))
    save_file(
        {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}, str(out / "model.safetensors")
    )
    (out / "aerie.json").write_text(
        json.dumps({"family": "toy", "target": target.name, **(provenance or {})})
    )
    return out


def load_toy(path: str | Path, target: TargetInfo, device: Any = "cpu", dtype: Any = None) -> ToyDrafter:
    provenance = json.loads((Path(path) / "aerie.json").read_text())
    if provenance.get("family") != "toy":
        raise TargetError(f"{path} holds a {provenance.get('family')} drafter, not a toy one")
    drafter = ToyDrafter()
    drafter.load_state_dict(load_file(str(Path(path) / "model.safetensors")))
    return drafter


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
    objective=Part("tests.toy_family:ToyObjective"),
    export=Part("tests.toy_family:export_toy"),
    loader=Part("tests.toy_family:load_toy"),
    proposer=Part("tests.toy_family:ToyProposer"),
)
