"""Stage keys and manifests: how data flows forward between stages.

Every stage writes under `<run>/<stage>/<key>/` of the artifact store, where `key` hashes the stage's
config, its upstream manifest(s) and the aerie version. Its last act is writing `manifest.json` there
(atomically), so "manifest exists" means "stage complete" and a re-run with the same key is a cache
hit even without Prefect's cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

from pydantic import BaseModel, Field

from aerie.errors import IntegrityError, ObjectNotFoundError, StoreError
from aerie.store import ArtifactStore
from aerie.version import __version__

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


def canonical_json(obj: Any) -> bytes:
    """JSON with sorted keys and no whitespace: the bytes that get hashed."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json")
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def stage_key(stage: str, config: Any, upstream: list[str] | tuple[str, ...] = ()) -> str:
    """16 hex chars of sha256 over the stage name, its config, upstream manifest digests and aerie's version."""
    payload = {"stage": stage, "config": config, "upstream": list(upstream), "aerie": __version__}
    return hashlib.sha256(canonical_json(payload)).hexdigest()[:16]


class StageResult(BaseModel):
    """What a stage's `run()` returns: where its manifest is, never the data itself."""

    stage: str
    key: str
    prefix: str = Field(description="Store key prefix `<run>/<stage>/<key>`.")
    manifest_uri: str
    manifest_sha256: str
    cache_hit: bool
    seconds: float = Field(description="This run's time for the stage (for a cache hit: finding it).")
    original_seconds: float | None = Field(
        None, description="For a cache hit: the seconds the stage took when it ran."
    )
    figures: dict[str, Any] = Field(default_factory=dict, description="Key figures for the summary.")


class StageDir:
    """One stage's output prefix in a store."""

    def __init__(self, store: ArtifactStore, run: str, stage: str, key: str) -> None:
        self.store, self.run, self.stage, self.key = store, run, stage, key
        self.prefix = f"{run}/{stage}/{key}"
        self.started = time.monotonic()

    def path(self, name: str) -> str:
        """The store key of a file in this stage's prefix."""
        return f"{self.prefix}/{name}"

    def uri(self, name: str) -> str:
        return self.store.uri(self.path(name))

    def manifest(self) -> dict[str, Any] | None:
        """The manifest if the stage completed earlier, None if it did not (no manifest, or a corrupt
        one: the stage re-runs and rewrites it). Any other store error raises: a store that cannot be
        reached says nothing about what is cached, and taking it for "not cached" would start the
        stage's work only to fail later, at its first write."""
        uri = self.uri(MANIFEST)
        try:
            raw = self.store.get_bytes(self.path(MANIFEST))
        except ObjectNotFoundError:
            return None
        except IntegrityError as exc:
            log.warning("%s is corrupt (%s): the stage runs again and rewrites it", uri, exc)
            return None
        try:
            manifest = json.loads(raw)
        except ValueError as exc:
            log.warning("%s is not valid JSON (%s): the stage runs again and rewrites it", uri, exc)
            return None
        if not isinstance(manifest, dict):
            log.warning("%s is not a JSON object: the stage runs again and rewrites it", uri)
            return None
        return manifest

    def cached_result(self) -> StageResult | None:
        manifest = self.manifest()
        if manifest is None:
            return None
        return self._result(manifest, cache_hit=True)

    def finish(self, manifest: dict[str, Any]) -> StageResult:
        """Write the manifest (the stage's last act) and return the result."""
        body = {
            "schema_version": SCHEMA_VERSION,
            "stage": self.stage,
            "key": self.key,
            "run": self.run,
            "aerie_version": __version__,
            "created_unix": time.time(),
            "seconds": round(time.monotonic() - self.started, 3),
            **manifest,
        }
        self.store.put_bytes(self.path(MANIFEST), json.dumps(body, indent=2, default=str).encode())
        return self._result(body, cache_hit=False)

    def _result(self, manifest: dict[str, Any], *, cache_hit: bool) -> StageResult:
        return StageResult(
            stage=self.stage,
            key=self.key,
            prefix=self.prefix,
            manifest_uri=self.uri(MANIFEST),
            manifest_sha256=manifest_digest(manifest),
            cache_hit=cache_hit,
            seconds=round(time.monotonic() - self.started, 3)
            if cache_hit
            else float(manifest.get("seconds", 0.0)),
            original_seconds=float(manifest.get("seconds", 0.0)) if cache_hit else None,
            figures=dict(manifest.get("figures", {})),
        )


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The digest downstream keys are built from. Timing fields (and the plan's estimate beside them,
    `aerie.plan.track`) are left out so a re-run that produced the same outputs gives the same digest."""
    stable = {k: v for k, v in manifest.items() if k not in ("created_unix", "seconds", "plan")}
    return hashlib.sha256(canonical_json(stable)).hexdigest()


def load_manifest(store: ArtifactStore, prefix: str) -> dict[str, Any]:
    """Read an upstream stage's manifest; a clear error when that stage never completed."""
    try:
        return json.loads(store.get_bytes(f"{prefix}/{MANIFEST}"))
    except ObjectNotFoundError as exc:
        raise StoreError(f"stage output {prefix!r} has no manifest: that stage did not complete") from exc
