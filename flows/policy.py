"""How Prefect runs one stage: its task's name and retries, and what it shows in the UI. Each stage's
flow module defines one (`flows.merge.POLICY`, ...); `flows.stage` applies them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from aerie.config import PipelineConfig
from aerie.manifest import StageResult
from aerie.stage import StagePart
from aerie.store import ArtifactStore

# A part's row in the stage's parts table: its record, the exception that stopped it, or None where an
# earlier run finished it.
PartRow = Callable[[StagePart, BaseModel | BaseException | None], dict[str, Any]]


def _part_row(part: StagePart, outcome: BaseModel | BaseException | None) -> dict[str, Any]:
    if isinstance(outcome, BaseException):
        return {"part": part.label, "status": f"failed: {type(outcome).__name__}"}
    return {"part": part.label, "status": "done before" if outcome is None else "done"}


def _no_deployment(cfg: PipelineConfig) -> str | None:
    return None


@dataclass(frozen=True)
class StagePolicy:
    task: str  # the stage task's name in the UI (and its cache key's prefix); a part's task's too
    title: str  # the progress artifact's description
    summary: Callable[[StageResult], str]  # the figures table's description
    retries: int = 0
    retry_delay_s: float | list[float] = 0.0
    # Failures a retry cannot fix (a bad config, bad data, a disk too small): never retried.
    not_retried: tuple[type[BaseException], ...] = ()
    # Artifacts beyond the figures table (report tables, plots), from the stage's output in the store.
    report: Callable[[StageResult, ArtifactStore], None] | None = None
    # A stage of parts (`aerie.stage.StagePart`): the name of each part's subflow, the deployment whose runs
    # take the parts instead (each on the host its worker runs on), and the table of the parts.
    part_flow: str = "stage-part"
    part_deployment: Callable[[PipelineConfig], str | None] = _no_deployment
    parts_table: str = "parts"
    part_row: PartRow = _part_row


def default_policy(stage: str) -> StagePolicy:
    """The policy of a stage whose flow module defines none: named after the stage, never retried (a
    new stage says what a retry can fix before it gets one), no reports beyond its figures."""
    return StagePolicy(
        task=stage,
        title=f"running {stage}",
        summary=lambda result: f"{stage}: figures",
        part_flow=f"{stage}-part",
    )
