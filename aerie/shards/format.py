"""One sample's hidden states and one closed shard, as the writer and the reader hand them over
(layout: `aerie.shards`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aerie.shards.schema import ids_bytes


@dataclass
class HiddenSample:
    """One sample's hidden states, as the extraction client hands them to the writer and the reader
    gives them back (dequantized)."""

    id: str
    input_ids: torch.Tensor  # [T] integer (int32 as shards store them, or int64)
    loss_mask: torch.Tensor  # [T] bool or uint8 (0/1)
    aux_hidden: torch.Tensor  # [T, 3H]
    last_hidden: torch.Tensor  # [T, H]
    # Set when the states arrive already quantized (a server dumping fp8): aux_hidden and last_hidden
    # are then float8_e4m3fn codes and these their per-token scales, as a shard stores them.
    aux_scale: torch.Tensor | None = None  # [T, 3] uint8 (E8M0)
    last_scale: torch.Tensor | None = None  # [T, 1] uint8

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def quantized(self) -> bool:
        return self.aux_scale is not None


@dataclass(frozen=True)
class WriteTiming:
    """Where writing a shard spent its time (seconds), for the commit path's accounting
    (`aerie.extract.phases`): `data` in `SealedShard.write_data` (which also prepares the layout:
    offsets, concatenating ids, masks and scales, the header), the rest in `WrittenShard.sync`."""

    data: float = 0.0  # the writev calls (and queueing the buffers for the hash thread)
    hash_wait: float = 0.0  # waiting for the hash thread once the data was flushed and fsynced
    fsync: float = 0.0  # flush + fsync + close of the temp file, rename, fsync of the directory


@dataclass
class ShardInfo:
    """A closed shard: what the manifest and the progress file record."""

    name: str
    path: Path
    samples: int
    tokens: int
    bytes: int
    sha256: str
    sample_ids: list[str] = field(repr=False)
    # How long writing it took, by step (zeros where the info did not come from a write).
    timing: WriteTiming = field(default_factory=WriteTiming, repr=False, compare=False)

    def record(self) -> dict[str, Any]:
        """The manifest entry (no local path: the shard moves to the store)."""
        return {
            "name": self.name,
            "samples": self.samples,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "sha256": self.sha256,
        }


def ids_dtype(vocab_size: int | None) -> torch.dtype:
    """How a shard stores token ids (`aerie.shards.schema.ids_bytes`): uint16 where they fit, else int32."""
    return torch.uint16 if ids_bytes(vocab_size) == 2 else torch.int32
