"""Prefect flow of the merge stage: conversations -> tokenized, shuffled, split corpus -> stats.

Thin on purpose: `aerie.corpus.run` does the work. The merge task is cached on the library's own
stage key (corpus config without its execution knobs, tokenizer and chat-template hashes, upstream
manifest digests) plus where the output lives; the stage's manifest makes a re-run a hit even
without Prefect. A retry re-runs the stage from its inputs (minutes at most); bad data (a schema
that does not match, a target without a chat template) is not retried: it would fail the same way.

Reported in the UI: a progress artifact while tokenizing, a table of the key figures, a table of
records and tokens per split and source with the dropped counts by reason, and the length
histogram as an image.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.context import TaskRunContext

from aerie import corpus
from aerie.corpus.config import CorpusConfig
from aerie.corpus.stage import key_of
from aerie.errors import ConfigError, DataError
from aerie.manifest import StageResult, canonical_json, load_manifest
from aerie.store import StoreConfig, open_store
from aerie.targets import TargetInfo
from flows.reporting import artifact_key, image_artifact, notify_failure, prefect_progress, stage_table
from flows.retrying import retry_unless
from flows.stagecache import run_cached

_worth_retrying = retry_unless(DataError, ConfigError)


def _cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    store_cfg: StoreConfig = parameters["store_cfg"]
    key = key_of(parameters["cfg"], parameters["target"], parameters["inputs"])
    payload = [store_cfg.uri, parameters["run_name"], key]
    return f"aerie-merge-{hashlib.sha256(canonical_json(payload)).hexdigest()[:24]}"


@task(
    name="merge-corpus",
    cache_key_fn=_cache_key,
    persist_result=True,
    retries=1,
    retry_delay_seconds=10,
    retry_condition_fn=_worth_retrying,
)
def merge_task(
    cfg: CorpusConfig, store_cfg: StoreConfig, run_name: str, target: TargetInfo, inputs: list[StageResult]
) -> StageResult:
    progress = prefect_progress(artifact_key(run_name, "merge"), "merging the corpus")
    return corpus.run(
        cfg, store=open_store(store_cfg), run_name=run_name, target=target, inputs=inputs, progress=progress
    )


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


@task(name="merge-report", retries=2, retry_delay_seconds=5)
def report_task(result: StageResult, store_cfg: StoreConfig) -> None:
    store = open_store(store_cfg)
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
    with tempfile.TemporaryDirectory() as tmp:
        local = store.get_file(f"{result.prefix}/{name}", Path(tmp) / name)
        image_artifact(local, key="merge-length-hist", description="corpus sample lengths")


@flow(name="merge", on_failure=[notify_failure], on_crashed=[notify_failure])
def merge_corpus(
    cfg: CorpusConfig,
    store_cfg: StoreConfig,
    run_name: str,
    target: TargetInfo,
    inputs: list[StageResult],
) -> StageResult:
    """Merge the generated conversations into the training corpus; returns the stage result (a pointer)."""
    result = run_cached(
        merge_task,
        open_store(store_cfg),
        cfg=cfg,
        store_cfg=store_cfg,
        run_name=run_name,
        target=target,
        inputs=inputs,
    )
    f = result.figures
    stage_table(
        result,
        f"merge: {f.get('text')}, supervised fraction {f.get('supervised_fraction')}, {f.get('dropped')} dropped",
    )
    report_task(result, store_cfg)
    return result


# The name the pipeline flow composes.
merge_flow = merge_corpus
