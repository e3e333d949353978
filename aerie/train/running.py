"""What a family's objective reads of the running loop (`aerie.train.loop.Trainer` has it), so the
objectives type their trainer argument without importing the loop that imports them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from aerie.train.distributed import DistInfo


class RunningLoop(Protocol):
    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def attention(self) -> str: ...

    @property
    def dist(self) -> DistInfo: ...

    @property
    def drafter(self) -> nn.Module: ...

    @property
    def teacher(self) -> Any:
        """The teacher its own `build` returned (each family's is its own type)."""
        ...
