"""Deterministic split and shuffle by content hash, done as an external shuffle in bounded memory.

Every conversation's place follows from its content hash and the split seed alone: a keyed hash decides
train or eval, another gives its shuffle key. Adding data therefore moves no existing conversation
to the other split and keeps the relative order of the old ones. Output shard b of a split holds the
keys in [b, b+1) / n_buckets of the key range, so the shards concatenated are sorted by key: a global
shuffle, while only one shard is ever in memory. Duplicates share a hash, hence a shard, and are
removed there (the first occurrence in input order is kept).

Tokenized rows reach `Spill` in batches and are buffered up to a budget, then written to one Arrow
file per (split, shard) and flush; `Spill.shard(...)` reads one shard's files back.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from aerie.diskspace import writing
from aerie.errors import DataError

SPLITS = ("train", "eval")
TRAIN, EVAL = 0, 1


@dataclass(frozen=True)
class Layout:
    """How many shards each split has, fixed before tokenization from the input row count."""

    seed: int
    eval_fraction: float
    buckets: tuple[int, int]  # (train, eval)

    @classmethod
    def plan(cls, rows: int, *, seed: int, eval_fraction: float, rows_per_shard: int) -> Layout:
        eval_rows = rows * eval_fraction
        train = max(1, math.ceil((rows - eval_rows) / rows_per_shard))
        held_out = max(1, math.ceil(eval_rows / rows_per_shard)) if eval_fraction > 0 else 0
        return cls(seed=seed, eval_fraction=eval_fraction, buckets=(train, held_out))

    def place(self, digest: bytes) -> tuple[int, int, int]:
        """(split, shard, shuffle key) of a conversation with content hash `digest`."""
        split = TRAIN
        if self.eval_fraction > 0 and _keyed(digest, f"split:{self.seed}") < self.eval_fraction * 2**64:
            split = EVAL
        order = _keyed(digest, f"order:{self.seed}")
        return split, (order * self.buckets[split]) >> 64, order


def _keyed(digest: bytes, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(digest, key=key.encode(), digest_size=8).digest(), "little")


class Spill:
    """Tokenized rows partitioned by (split, shard), buffered in memory up to `budget_bytes`."""

    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root = root
        self.budget = budget_bytes
        self._buffers: dict[tuple[int, int], list[pl.DataFrame]] = defaultdict(list)
        self._files: dict[tuple[int, int], list[Path]] = defaultdict(list)
        self._buffered = 0
        self._flushes = 0
        root.mkdir(parents=True, exist_ok=True)

    def add(self, frame: pl.DataFrame) -> None:
        """`frame` has the spill columns plus `split` and `bucket`."""
        if frame.is_empty():
            return
        for (split, bucket), part in frame.partition_by(["split", "bucket"], as_dict=True).items():
            self._buffers[(int(split), int(bucket))].append(part.drop("split", "bucket"))  # type: ignore[call-overload]
        self._buffered += int(frame.estimated_size())
        if self._buffered >= self.budget:
            self.flush()

    def flush(self) -> None:
        for where, parts in self._buffers.items():
            path = self.root / f"{SPLITS[where[0]]}-{where[1]:05d}-{self._flushes:05d}.arrow"
            with writing(path, DataError):
                pl.concat(parts, rechunk=False).write_ipc(path, compression="uncompressed")
            self._files[where].append(path)
        self._buffers.clear()
        self._buffered = 0
        self._flushes += 1

    def shard(self, split: int, bucket: int) -> pl.DataFrame | None:
        """All rows spilled for one shard, or None if it got none."""
        files = self._files.get((split, bucket), [])
        if not files:
            return None
        return pl.concat([pl.read_ipc(f) for f in files], rechunk=False)

    def release(self, split: int, bucket: int) -> None:
        for f in self._files.pop((split, bucket), []):
            f.unlink(missing_ok=True)


def dedupe_and_order(frame: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Sort a shard by shuffle key and drop duplicates. Returns (kept rows, dropped duplicates with the
    id and source of the copy that was kept)."""
    frame = frame.sort(["order", "hash", "src", "sub"])
    first = pl.col("src").min().over("hash")
    kept = frame.filter(pl.col("src") == first)
    dropped = frame.filter(pl.col("src") != first)
    if dropped.is_empty():
        return kept, dropped.select("id", "source", kept_id=pl.col("id"), kept_source=pl.col("source"))
    originals = kept.group_by("hash").agg(kept_id=pl.col("id").first(), kept_source=pl.col("source").first())
    dropped = (
        dropped.group_by("src", maintain_order=True)
        .agg(pl.col("id").first(), pl.col("source").first(), pl.col("hash").first())
        .join(originals, on="hash", how="left")
        .select("id", "source", "kept_id", "kept_source")
    )
    return kept, dropped
