"""Where an extraction's shards are in the store: the keys its manifest lists (train and held-out
eval), and those the store does not hold. Extraction checks a cached result with them; training reads
the shards by them."""

from __future__ import annotations

from typing import Any

from aerie.errors import DataError
from aerie.manifest import StageResult, load_manifest
from aerie.store import ArtifactStore


def shard_keys(extract: dict[str, Any], prefix: str) -> tuple[list[str], list[str]]:
    """Store keys of the train and eval shards an extract manifest lists (no splits: all are train)."""

    def keys(records: list[dict[str, Any]]) -> list[str]:
        return [f"{prefix}/{r.get('path') or r['name']}" for r in records]

    splits = extract.get("splits")
    if splits:
        train = keys(splits.get("train", {}).get("shards", []))
        held = keys(splits.get("eval", {}).get("shards", []))
    else:
        train, held = keys(extract.get("shards", [])), []
    if not train:
        raise DataError(f"the extract stage at {prefix} lists no training shards")
    return train, held


def missing_shards(store: ArtifactStore, result: StageResult) -> list[str]:
    """The shards `result`'s manifest lists that the store does not hold: a manifest that travelled
    without its shards (copied to another host as a manifest alone), or shards deleted since."""
    train, held = shard_keys(load_manifest(store, result.prefix), result.prefix)
    return [key for key in (*train, *held) if not store.exists(key)]
