"""Reading a finished corpus: what the extraction and training stages call.

Rows stream one Parquet row group at a time, so a reader holds a few thousand samples, not a shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import polars as pl

from aerie.errors import DataError
from aerie.manifest import StageResult, load_manifest
from aerie.store import ArtifactStore
from aerie.workdirs import work_dir

READ_BATCH = 1024


class CorpusRow(NamedTuple):
    id: str
    source: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 = a supervised (assistant) token


def corpus_shards(store: ArtifactStore, result: StageResult, split: str) -> list[str]:
    """Store keys of a split's shards, in corpus order (shard 0 first)."""
    manifest = load_manifest(store, result.prefix)
    splits = manifest.get("splits", {})
    if split not in splits:
        raise DataError(f"corpus {result.prefix} has no split {split!r} (splits: {', '.join(splits)})")
    return [shard["key"] for shard in splits[split]["shards"]]


def iter_corpus(store: ArtifactStore, result: StageResult, split: str) -> Iterator[CorpusRow]:
    """Every row of a split in corpus order (the shuffled order the merge stage wrote)."""
    for key in corpus_shards(store, result, split):
        local = store.local_path(key)
        if local is not None and local.is_file():
            # Read in place, but only once its bytes match the sha256 recorded when it was stored: a
            # flipped bit in a Parquet page may decode into wrong token ids without any error.
            store.open(key).close()
            yield from _rows(local)
            continue
        with work_dir("aerie-corpus-") as tmp:
            yield from _rows(store.get_file(key, Path(tmp) / Path(key).name))


def _rows(path: Path) -> Iterator[CorpusRow]:
    lazy = pl.scan_parquet(path).select("id", "source", "input_ids", "loss_mask")
    for batch in lazy.collect_batches(chunk_size=READ_BATCH):
        for row in batch.iter_rows():
            yield CorpusRow(*row)
