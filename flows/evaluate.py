"""The evaluate stage under Prefect: acceptance of the drafter beside prompt lookup, as tables and a plot.

`aerie.evaluate` does the work, through the generic stage subflow (`flows.stage`). Its measurements
are written one by one, so the task's retry measures only what is missing.
"""

from __future__ import annotations

from pathlib import Path

from prefect.artifacts import create_markdown_artifact

from aerie.evaluate.report import ACCEPTANCE_PNG
from aerie.manifest import StageResult
from aerie.store import ArtifactStore
from aerie.workdirs import work_dir

from .policy import StagePolicy
from .reporting import artifact_key, image_artifact


def report(result: StageResult, store: ArtifactStore) -> None:
    """The report's tables as a markdown artifact and the acceptance-per-position plot as an image."""
    create_markdown_artifact(
        store.get_bytes(f"{result.prefix}/report.md").decode(),
        key=artifact_key(result.stage, "report"),
        description="acceptance length and per-position acceptance",
    )
    with work_dir("aerie-report-") as tmp:
        local = store.get_file(f"{result.prefix}/{ACCEPTANCE_PNG}", Path(tmp) / ACCEPTANCE_PNG)
        image_artifact(
            local,
            key="evaluate-acceptance",
            description="acceptance per draft position and by position in the output",
        )


POLICY = StagePolicy(
    task="evaluate-drafter",
    title="speculative decoding evaluation",
    summary=lambda result: "evaluate: acceptance length per dataset, proposer and draft steps",
    retries=1,
    retry_delay_s=10,
    report=report,
)
