"""The deploy stage under Prefect: the speculative server against the baseline, and the promotion.

`aerie.deploy` launches the servers through `aerie.serving` (readiness, nonce, teardown) and
benchmarks them, through the generic stage subflow (`flows.stage`). No retry: a benchmark re-run on a
flaky host would mix conditions; a failed deploy is re-run as a whole, and a finished one is a cache
hit.
"""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact

from aerie.manifest import StageResult
from aerie.store import ArtifactStore

from .policy import StagePolicy
from .reporting import artifact_key


def report(result: StageResult, store: ArtifactStore) -> None:
    """The benchmark table and the promotion decision as a markdown artifact (none when disabled)."""
    key = f"{result.prefix}/report.md"
    if store.exists(key):
        create_markdown_artifact(
            store.get_bytes(key).decode(),
            key=artifact_key("deploy", "report"),
            description="serving benchmark",
        )


POLICY = StagePolicy(
    task="deploy-benchmark",
    title="deployment benchmark",
    summary=lambda r: f"deploy: speed-up {r.figures.get('speedup')}, promoted: {r.figures.get('promoted')}",
    report=report,
)
