"""The corpus as extraction reads it: rows in a fixed order, addressable by index, sliced per server.

The merge stage writes `<split>-*.parquet` shards (id, source, input_ids, loss_mask, n_tokens, ...).
Extraction needs more than a stream: a deterministic global order (shard file name, then row), the
row count and token count per split without reading the token lists, and a cheap jump to row `i` when a
re-run or a restarted server resumes mid-split. Rows are read in windows, so a 50K-row shard of 4K-token
samples is never held in memory at once.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from aerie.errors import DataError, SchemaError, StoreError
from aerie.manifest import load_manifest
from aerie.store import ArtifactStore

COLUMNS = ("id", "input_ids", "loss_mask")
WINDOW_ROWS = 256


@dataclass(frozen=True)
class Row:
    """One corpus sample with its position in the split."""

    index: int
    id: str
    input_ids: list[int]
    loss_mask: list[int]


def _is_split_file(key: str, prefix: str, split: str) -> bool:
    rel = key[len(prefix) :].lstrip("/")
    return bool(re.match(rf"^(?:{split}/[^/]+|{split}-[^/]*)\.parquet$", rel))


@dataclass
class SplitFiles:
    """One split's parquet files in order, with their row counts."""

    split: str
    paths: list[Path]
    rows: list[int]
    tokens: int

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    def iter_rows(self, start: int = 0, end: int | None = None) -> Iterator[Row]:
        """Rows [start, end) of the split, in order."""
        end = self.total_rows if end is None else min(end, self.total_rows)
        base = 0
        for path, n in zip(self.paths, self.rows, strict=True):
            lo, hi = max(start, base), min(end, base + n)
            for off in range(lo - base, hi - base, WINDOW_ROWS):
                length = min(WINDOW_ROWS, hi - base - off)
                frame = pl.scan_parquet(path).select(COLUMNS).slice(off, length).collect()
                for i, (sid, ids, mask) in enumerate(frame.iter_rows()):
                    yield Row(index=base + off + i, id=str(sid), input_ids=list(ids), loss_mask=list(mask))
            base += n
            if base >= end:
                return


def open_split(store: ArtifactStore, prefix: str, split: str, cache_dir: Path) -> SplitFiles:
    """A split's parquet shards in corpus order, with row and token counts.

    The merge stage's manifest lists them (`splits.<split>.shards[].key/rows/tokens`); a corpus
    without that list (older layouts) is found by name (`<split>-*.parquet`) and counted from the
    parquet files. Shards of a remote store are downloaded into `cache_dir` once."""
    listed = _manifest_shards(store, prefix, split)
    if listed is not None:
        keys = [str(s["key"]) for s in listed]
    else:
        keys = sorted(k for k in store.list(prefix) if _is_split_file(k, prefix, split))
    paths = [_local(store, key, cache_dir) for key in keys]
    rows: list[int] = []
    tokens = 0
    for i, path in enumerate(paths):
        _check_schema(path)
        if listed is not None and "rows" in listed[i] and "tokens" in listed[i]:
            rows.append(int(listed[i]["rows"]))
            tokens += int(listed[i]["tokens"])
            continue
        n, t = _count(path)
        rows.append(n)
        tokens += t
    return SplitFiles(split=split, paths=paths, rows=rows, tokens=tokens)


def _manifest_shards(store: ArtifactStore, prefix: str, split: str) -> list[dict[str, Any]] | None:
    try:
        manifest = load_manifest(store, prefix)
    except StoreError:
        return None
    shards = (manifest.get("splits") or {}).get(split, {}).get("shards")
    return list(shards) if isinstance(shards, list) else None


def _local(store: ArtifactStore, key: str, cache_dir: Path) -> Path:
    local = store.local_path(key)
    if local is not None and local.is_file():
        return local
    dest = cache_dir / key
    if not dest.exists():
        store.get_file(key, dest)
    return dest


def _check_schema(path: Path) -> None:
    try:
        schema = pl.read_parquet_schema(path)
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise DataError(f"cannot read corpus shard {path}: {exc}") from exc
    missing = [c for c in COLUMNS if c not in schema]
    if missing:
        raise SchemaError(f"{path}: corpus shard lacks columns {missing} (has {list(schema)})")


def _count(path: Path) -> tuple[int, int]:
    try:
        counts = (
            pl.scan_parquet(path)
            .select(pl.len().alias("rows"), pl.col("input_ids").list.len().sum().alias("tokens"))
            .collect()
        )
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise DataError(f"cannot read corpus shard {path}: {exc}") from exc
    return int(counts["rows"][0]), int(counts["tokens"][0] or 0)


def slice_bounds(total: int, num_slices: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges, sizes differing by at most one row."""
    base, extra = divmod(total, num_slices)
    out, start = [], 0
    for k in range(num_slices):
        end = start + base + (1 if k < extra else 0)
        out.append((start, end))
        start = end
    return out
