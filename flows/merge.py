"""The merge stage under Prefect: conversations -> tokenized, shuffled, split corpus -> stats.

`aerie.corpus` does the work, through the generic stage subflow (`flows.stage`). A retry re-runs the
stage from its inputs (minutes at most); bad data (a schema that does not match, a target without a
chat template) is not retried: it would fail the same way.

Reported in the UI: a progress artifact while tokenizing, a table of the key figures, a table of
records and tokens per split and source with the dropped counts by reason, and the length
histogram as an image.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.artifacts import create_table_artifact

from aerie.errors import ConfigError, DataError
from aerie.manifest import StageResult, load_manifest
from aerie.store import ArtifactStore
from aerie.workdirs import work_dir

from .policy import StagePolicy
from .reporting import artifact_key, image_artifact


def split_rows(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per split and source, then one per split total: records, tokens, supervised share."""
    rows = []
    for split, s in manifest["splits"].items():
        for source, v in s["by_source"].items():
            rows.append(_row(split, source, v))
        rows.append(_row(split, "(all)", s))
    return rows


def _row(split: str, source: str, v: dict[str, Any]) -> dict[str, Any]:
    tokens = v["tokens"]
    return {
        "split": split,
        "source": source,
        "records": v["records"],
        "tokens": tokens,
        "supervised tokens": v["supervised_tokens"],
        "supervised fraction": round(v["supervised_tokens"] / tokens, 4) if tokens else 0.0,
        "corpus": v["text"],
    }


def report(result: StageResult, store: ArtifactStore) -> None:
    manifest = load_manifest(store, result.prefix)
    create_table_artifact(
        split_rows(manifest),
        key=artifact_key(result.stage, "splits"),
        description=f"corpus: {manifest['figures']['text']} (records and tokens per split and source)",
    )
    dropped = [{"reason": k, "conversations": v} for k, v in manifest["dropped"].items()]
    notes = [{"reason": f"note: {k}", "conversations": v} for k, v in manifest["notes"].items()]
    create_table_artifact(
        dropped + notes,
        key=artifact_key(result.stage, "dropped"),
        description=f"dropped by reason (see {manifest['files']['quarantine']}), and what the template noticed",
    )
    name = manifest["files"]["length_hist"]
    with work_dir("aerie-report-") as tmp:
        local = store.get_file(f"{result.prefix}/{name}", Path(tmp) / name)
        image_artifact(local, key="merge-length-hist", description="corpus sample lengths")


def _summary(result: StageResult) -> str:
    f = result.figures
    return f"merge: {f.get('text')}, supervised fraction {f.get('supervised_fraction')}, {f.get('dropped')} dropped"


POLICY = StagePolicy(
    task="merge-corpus",
    title="merging the corpus",
    summary=_summary,
    retries=1,
    retry_delay_s=10,
    not_retried=(DataError, ConfigError),
    report=report,
)
