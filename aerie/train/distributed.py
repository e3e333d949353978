"""torch.distributed for the trainer: one process per GPU under torchrun (NCCL), or gloo processes on a CPU
host (how the DDP path is tested without GPUs). A single process needs none of it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def reduce(self, x: Tensor) -> Tensor:
        """Sum over ranks, in place (a no-op in one process)."""
        if self.world > 1:
            dist.all_reduce(x)
        return x

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group torchrun describes in the environment; single-process when there is none."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return DistInfo()
    local_rank = int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend="nccl" if device_type == "cuda" else "gloo", timeout=timedelta(minutes=30)
    )
    return DistInfo(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local_rank)


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
