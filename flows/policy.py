"""How Prefect runs one stage: its task's name and retries, and what it shows in the UI. Each stage's
flow module defines one (`flows.merge.POLICY`, ...); `flows.stage` applies them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aerie.manifest import StageResult
from aerie.store import ArtifactStore


@dataclass(frozen=True)
class StagePolicy:
    task: str  # the stage task's name in the UI (and its cache key's prefix)
    title: str  # the progress artifact's description
    summary: Callable[[StageResult], str]  # the figures table's description
    retries: int = 0
    retry_delay_s: float = 0.0
    # Failures a retry cannot fix (a bad config, bad data, a disk too small): never retried.
    not_retried: tuple[type[BaseException], ...] = ()
    # Artifacts beyond the figures table (report tables, plots), from the stage's output in the store.
    report: Callable[[StageResult, ArtifactStore], None] | None = None


def default_policy(stage: str) -> StagePolicy:
    """The policy of a stage whose flow module defines none: named after the stage, never retried (a
    new stage says what a retry can fix before it gets one), no reports beyond its figures."""
    return StagePolicy(task=stage, title=f"running {stage}", summary=lambda result: f"{stage}: figures")
