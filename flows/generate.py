"""The generation stage under Prefect: a subflow per dataset (`generate-<dataset>`, the stage's parts),
datasets in parallel up to `generate.max_parallel_datasets`, around one endpoint (`flows.stage` runs
them; `aerie.generate.stage.GENERATE` says what they are).

The generation task retries (a re-run resumes from the journal, so a retry costs only the requests in
flight), except for errors that a retry cannot fix: a rejected key, a wrong URL or model, a bad config,
bad source data. Each dataset gets a progress artifact and a table of its figures; the stage adds one
table over all datasets (`<run>-generate-datasets`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from aerie.errors import (
    ConfigError,
    DataError,
    EndpointAuthError,
    EndpointRequestError,
    EndpointUnreachableError,
)
from aerie.manifest import StageResult
from aerie.stage import StagePart

from .policy import StagePolicy


def _summary(result: StageResult) -> str:
    f = result.figures
    return (
        f"{result.stage}: {f.get('records')} conversations, {f.get('failed')} failed, "
        f"{f.get('completion_tokens')} completion tokens"
    )


def _row(part: StagePart, outcome: BaseModel | BaseException | None) -> dict[str, Any]:
    dataset = part.label.removeprefix("dataset ")
    if isinstance(outcome, BaseException):
        return {"dataset": dataset, "status": f"failed: {type(outcome).__name__}"}
    if not isinstance(outcome, StageResult):
        return {"dataset": dataset, "status": "cached"}
    f = outcome.figures
    return {
        "dataset": dataset,
        "status": "cached" if outcome.cache_hit else "generated",
        "records": f.get("records"),
        "failed": f.get("failed"),
        "skipped": f.get("skipped"),
        "prompt tokens": f.get("prompt_tokens"),
        "completion tokens": f.get("completion_tokens"),
        "cost (USD)": f.get("cost_usd"),
        "requests/s": f.get("requests_per_s"),
        "tokens/s": f.get("tokens_per_s"),
        "manifest": outcome.manifest_uri,
    }


POLICY = StagePolicy(
    task="generate-conversations",
    title="generation",
    summary=_summary,
    retries=2,
    retry_delay_s=[30, 120],
    # A missing or malformed source fails the same way on every attempt (DataError covers both); an
    # endpoint that the check before generation found dead is named in seconds, not after minutes of
    # retries.
    not_retried=(EndpointAuthError, EndpointRequestError, EndpointUnreachableError, ConfigError, DataError),
    part_flow="generate-dataset",
    parts_table="datasets",
    part_row=_row,
)
