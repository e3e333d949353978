"""`progress.json`: which shards are safely in the store, so a re-run skips them.

Samples go to shards deterministically: each server slice is a fixed row range of a split, its samples
are packed in row order, and a shard closes when the next sample would not fit. A shard is therefore
fully described by (split, slice, index, first row, end row), and a re-run that starts again at the
end row of the last uploaded shard, with the next shard index, rebuilds exactly the shards that were
missing: no sample lost, none duplicated. An entry is added only after its upload was verified (the
store's sha256 equals the one computed while writing), and the file is rewritten atomically. A slice
of a multi-host run keeps its own progress object (`progress_key`): one writer per object.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass

from aerie.errors import ObjectNotFoundError, StoreError
from aerie.store import ArtifactStore

PROGRESS_FILE = "progress.json"
PROGRESS_VERSION = 1


def progress_key(slice_index: int | None, num_slices: int) -> str:
    """The progress object of a single-host run, or of one slice of a multi-host run: each slice has
    its own, because hosts writing one object concurrently would overwrite each other's entries (a
    store put replaces the whole object)."""
    if slice_index is None:
        return PROGRESS_FILE
    return f"slices/slice-{slice_index}-of-{num_slices}.progress.json"


@dataclass(frozen=True)
class ClosedShard:
    """A shard that is in the store."""

    split: str
    slice: int
    index: int
    name: str
    path: str  # relative to the stage prefix
    first_row: int
    end_row: int
    samples: int
    tokens: int
    bytes: int
    sha256: str

    def record(self) -> dict[str, object]:
        return asdict(self)


class ProgressFile:
    """The closed shards of one extraction stage key, persisted in the store."""

    def __init__(self, store: ArtifactStore, key: str) -> None:
        self.store = store
        self.key = key
        self._lock = threading.Lock()
        self.shards: list[ClosedShard] = []
        try:
            data = json.loads(store.get_bytes(key))
        except ObjectNotFoundError:
            return
        except (StoreError, ValueError):
            # A corrupt progress file only costs recomputation: start over.
            return
        if data.get("version") == PROGRESS_VERSION:
            self.shards = [ClosedShard(**s) for s in data.get("shards", [])]

    def resume_point(
        self, prefix: str, split: str, slice_index: int, start_row: int
    ) -> tuple[int, int, list[ClosedShard]]:
        """(row to resume from, next shard index, shards kept) for one slice. Only the unbroken run of
        shards 0..k whose objects exist in the store and whose rows chain from `start_row` is kept;
        anything after a gap is rebuilt (with the same names, so it is overwritten)."""
        mine = sorted(
            (s for s in self.shards if s.split == split and s.slice == slice_index), key=lambda s: s.index
        )
        kept: list[ClosedShard] = []
        row = start_row
        for s in mine:
            if s.index != len(kept) or s.first_row != row or not self.store.exists(f"{prefix}/{s.path}"):
                break
            kept.append(s)
            row = s.end_row
        with self._lock:
            drop = {(s.split, s.slice, s.index) for s in mine[len(kept) :]}
            if drop:
                self.shards = [s for s in self.shards if (s.split, s.slice, s.index) not in drop]
                self._save()
        return row, len(kept), kept

    def add(self, shard: ClosedShard) -> None:
        with self._lock:
            self.shards = [
                s
                for s in self.shards
                if (s.split, s.slice, s.index) != (shard.split, shard.slice, shard.index)
            ]
            self.shards.append(shard)
            self._save()

    def _save(self) -> None:
        body = {"version": PROGRESS_VERSION, "shards": [s.record() for s in self.shards]}
        self.store.put_bytes(self.key, json.dumps(body, indent=1).encode())
