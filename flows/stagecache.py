"""Prefect-level caching of stages across runs.

A stage task's cache key is built from what decides its output: the stage's config section, the
digests of its upstream manifests (never their timing fields), the run name, the store root and
aerie's version. The library's own manifests make a re-run cheap even without this cache; with it,
a finished stage is not even entered. A cache hit whose manifest has since been deleted from the
store is detected by `verified` and the stage re-runs.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from prefect.context import TaskRunContext
from pydantic import BaseModel

import aerie
from aerie.manifest import StageResult, canonical_json
from aerie.store import ArtifactStore

# Parameters that do not change a stage's output (callbacks, endpoints of a server launched for the run).
IGNORED = frozenset({"progress", "base_url"})


def _digestable(value: Any) -> Any:
    if isinstance(value, StageResult):
        return value.manifest_sha256
    if isinstance(value, list | tuple):
        return [_digestable(v) for v in value]
    if isinstance(value, dict):
        return {k: _digestable(v) for k, v in sorted(value.items())}
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value


def stage_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    payload = {
        "task": context.task.name,
        "aerie": aerie.__version__,
        "params": {k: _digestable(v) for k, v in sorted(parameters.items()) if k not in IGNORED},
    }
    return f"aerie-{context.task.name}-{hashlib.sha256(canonical_json(payload)).hexdigest()[:24]}"


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
