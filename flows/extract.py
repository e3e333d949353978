"""The extraction stage under Prefect.

On one host `aerie.extract` does the work through the generic stage subflow (`flows.stage`, with
`POLICY`): the disk preflight runs first inside the stage, so a shortage fails in seconds, before any
server starts, and is not retried; the task owns the servers (it launches, restarts and always tears
them down itself) and its retry resumes from the shards already uploaded (`progress.json`).

With `extract.num_slices` > 1 the slices are the stage's parts (`aerie.extract.stage.EXTRACT`): a
subflow each on this host, one after the other, or with `extract.slice_deployment` set (e.g.
"extract-slice/slice-gpu", prefect.yaml) a run of that deployment each, all at once, every slice host running
its own preflight (`flows.fanout`); the stage is then assembled from the slices' records.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from aerie.config import PipelineConfig
from aerie.errors import ConfigError, PreflightError
from aerie.extract.preflight import human_bytes
from aerie.extract.slices import SliceRecord
from aerie.manifest import StageResult
from aerie.stage import StagePart

from .policy import StagePolicy


def _summary(result: StageResult) -> str:
    f = result.figures
    return (
        f"extract: {f.get('tokens', 0):,} tokens in {f.get('shards', 0)} shards "
        f"({f.get('storage_dtype')}, {human_bytes(f.get('bytes', 0))})"
    )


def _slice_row(part: StagePart, outcome: BaseModel | BaseException | None) -> dict[str, Any]:
    if isinstance(outcome, BaseException):
        return {"slice": part.label, "status": f"failed: {type(outcome).__name__}"}
    if not isinstance(outcome, SliceRecord):  # done before, or run on another host: its record is there
        return {"slice": part.label, "status": "done before" if outcome is None else "done elsewhere"}
    return {
        "slice": part.label,
        "status": "done",
        "host": outcome.host,
        "servers": ", ".join(map(str, outcome.servers)),
        "tokens": outcome.tokens,
        "resumed rows": outcome.resumed_rows,
        "seconds": outcome.seconds,
    }


def _slice_deployment(cfg: PipelineConfig) -> str | None:
    return cfg.extract.slice_deployment


POLICY = StagePolicy(
    task="extract-hidden-states",
    title="hidden-state extraction",
    summary=_summary,
    retries=1,
    retry_delay_s=30,
    # A dead server or a store hiccup may pass in 30 s; a disk shortage or a bad config does not.
    not_retried=(PreflightError, ConfigError),
    part_flow="extract-slice",
    part_deployment=_slice_deployment,
    parts_table="slices",
    part_row=_slice_row,
)
