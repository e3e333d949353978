"""The parts' protocols: what a drafter family's objective, proposer, exporter and loader must be.

They live here, at the bottom of the house, so the family registry types its parts without importing
the packages that call them (the training loop, the engine): those packages import these protocols,
never the other way round. The loop's own types (its trainer, its packed rows, its teacher) are
type parameters of `Objective`, so this module needs none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from aerie.targets import DrafterShape, TargetGeometry, TargetInfo

TrainerT = TypeVar("TrainerT", contravariant=True)
BatchT = TypeVar("BatchT", contravariant=True)
TeacherT = TypeVar("TeacherT", covariant=True)


class Objective(Protocol[TrainerT, BatchT, TeacherT]):
    """A family's part of the training loop (`aerie.train.loop` gives it its trainer and packed rows):
    everything that differs between families; the loop around it is one."""

    width: int  # metric columns: TTT steps, or drafted slots of a block

    def drafter(self, target: TargetInfo, draft_vocab_size: int, dtype: torch.dtype = ...) -> nn.Module:
        """A fresh drafter (the stage also builds one to load the best weights into)."""
        ...

    def build(
        self, target: TargetInfo, vocab: dict[str, Tensor], dtype: torch.dtype
    ) -> tuple[nn.Module, TeacherT]:
        """The drafter to train and its teacher (on the CPU; the loop moves them)."""
        ...

    def loss(
        self, tr: TrainerT, model: nn.Module, batch: BatchT, reduce: Callable[[Tensor], Tensor], *, step: int
    ) -> tuple[Tensor, Tensor]:
        """(loss, metric sums [5, width]) of one packed row; `step` numbers the rows of this rank (the
        optimizer step when a step takes one row)."""
        ...

    def evaluate(self, tr: TrainerT, batch: BatchT) -> tuple[Tensor, tuple[int, int]]:
        """(metric sums, (rounds, verify tokens) of its answers walked) of one held-out row."""
        ...

    def window_loss(self, summary: dict[str, float | list[float]]) -> float:
        """The logged scalar, from per-column losses."""
        ...


class Proposer(Protocol):
    """Drafts tokens for the sequences being decoded. Sequences are named by stable integer ids.

    `add` is called once per sequence after the target's prefill, `propose` once per round for the
    active sequences, `advance` after each verify with what the target accepted, `remove` when a
    sequence finishes. `aux` (when `needs_aux`) holds the target's captured hidden states
    [n, len(aux_layers) * H] of the positions the target just processed, each paired with the token
    that followed that position: in `add`, `contexts` is prompt + first token and aux row i (position
    i) pairs with context[i + 1]; in `advance`, aux row i pairs with new_tokens[i].
    """

    name: str
    needs_aux: bool

    def add(
        self, seqs: Sequence[int], contexts: Sequence[list[int]], aux: Sequence[Tensor] | None
    ) -> None: ...

    def propose(self, seqs: Sequence[int], k: int) -> list[list[int]]: ...

    def advance(
        self, seqs: Sequence[int], new_tokens: Sequence[list[int]], aux: Sequence[Tensor] | None
    ) -> None: ...

    def remove(self, seqs: Sequence[int]) -> None: ...


class FamilyProposer(Proposer, Protocol):
    """A family's proposer: it also says which target hidden states it reads."""

    @property
    def aux_layers(self) -> list[int] | None: ...


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


class Diagnosis(Protocol):
    def __call__(
        self,
        model: Any,
        drafter: Any,
        pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
        steps: int,
        max_new_tokens: int,
    ) -> dict[str, Any]:
        """Teacher-forced figures of `drafter` over (prompt, answer) pairs the target answered greedily."""
        ...


class DraftShapeSource(Protocol):
    def resolve(self, geometry: TargetGeometry) -> DrafterShape: ...


class TrainSettings(Protocol):
    """The shared training settings a family reads (its parameter count, its checks); a family's own are
    its settings section (`aerie.train.config.TrainConfig` has both)."""

    @property
    def draft(self) -> DraftShapeSource: ...

    @property
    def batch_tokens(self) -> int: ...
