"""Prefect-level caching of stages across runs.

A stage task's cache key is the library's own stage key (`Stage.key`: what decides the output, aerie's
version included) plus where the output lives (store root, run name). The library's manifests make a
re-run cheap even without this cache; with it, a finished stage is not even entered. A cache hit whose
manifest has since been deleted from the store is detected by `verified` and the stage re-runs.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from aerie.manifest import StageResult, canonical_json
from aerie.store import ArtifactStore


def cache_key(task_name: str, store_uri: str, run_name: str, stage_key: str) -> str:
    digest = hashlib.sha256(canonical_json([store_uri, run_name, stage_key])).hexdigest()[:24]
    return f"aerie-{task_name}-{digest}"


def verified(store: ArtifactStore, result: StageResult) -> bool:
    """True when the result's manifest is still in the store (a Prefect cache hit may outlive it)."""
    return store.exists(f"{result.prefix}/manifest.json")


def run_cached(stage_task: Any, store: ArtifactStore, **params: Any) -> StageResult:
    """Call a cached stage task; if its cached result points at a manifest that is gone, re-run it."""
    started = time.monotonic()
    state = stage_task(**params, return_state=True)
    result: StageResult = state.result()
    if not verified(store, result):
        return stage_task.with_options(refresh_cache=True)(**params)
    if state.name != "Cached":
        return result
    # A Prefect cache hit returns the result object stored by the run that computed it: its seconds
    # are that run's, so this run's time replaces them and the original's is kept beside it.
    original = result.original_seconds if result.cache_hit else result.seconds
    return result.model_copy(
        update={
            "cache_hit": True,
            "seconds": round(time.monotonic() - started, 3),
            "original_seconds": original,
        }
    )
