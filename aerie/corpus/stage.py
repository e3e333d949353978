"""The merge stage: generated (or raw) conversations in, a tokenized, shuffled, split corpus out.

    conversations.parquet (one per upstream stage)
      -> Polars lazy concat in one schema (a mismatching column is a SchemaError naming it)
      -> batches -> workers: check, hash, place, render with the target's template, tokenize, mask
      -> spill by (split, shard) -> per shard: dedupe, order by shuffle key, write, count
      -> train-*.parquet, eval-*.parquet, token_counts.parquet, quarantine.jsonl, length_hist.png,
         manifest.json (last)

Memory is bounded by the spill budget plus one shard, whatever the corpus size.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from aerie.corpus.config import EXECUTION_FIELDS, CorpusConfig
from aerie.corpus.encoding import EncodeOptions, encoder_pool
from aerie.corpus.schema import CORPUS, task_frame
from aerie.corpus.shuffle import SPLITS, Layout, Spill, dedupe_and_order
from aerie.corpus.stats import SplitStats, TokenCounter, describe, length_histogram
from aerie.corpus.template import TemplateSpec
from aerie.errors import DataError
from aerie.manifest import StageDir, StageResult, stage_key
from aerie.progress import ProgressFn, no_progress
from aerie.store import ArtifactStore
from aerie.targets import TargetInfo

STAGE = "merge"
CONVERSATIONS = "conversations.parquet"
TOKEN_COUNTS = "token_counts.parquet"
QUARANTINE = "quarantine.jsonl"
LENGTH_HIST = "length_hist.png"
ROW_GROUP = 2048  # rows per Parquet row group: what a streaming reader holds at once

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True)
class InputFile:
    """One upstream `conversations.parquet` and where it came from."""

    stage: str
    key: str
    manifest_sha256: str


def tokenizer_sha256(target: TargetInfo) -> str:
    """Digest of the files that decide tokenization (the template is hashed with them)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = Path(target.path) / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def key_of(cfg: CorpusConfig, target: TargetInfo, inputs: list[StageResult]) -> str:
    content = cfg.model_dump(mode="json", exclude=set(EXECUTION_FIELDS))
    config = {
        "corpus": content,
        "tokenizer": tokenizer_sha256(target),
        "chat_template": target.chat_template_sha256,
    }
    return stage_key(STAGE, config, [r.manifest_sha256 for r in inputs])


def input_files(store: ArtifactStore, inputs: list[StageResult]) -> list[InputFile]:
    """The conversations files of the upstream results, in the order given (first occurrence wins dedupe)."""
    if not inputs:
        raise DataError("merge needs at least one upstream result with a conversations.parquet")
    files: list[InputFile] = []
    for result in inputs:
        keys = [k for k in store.list(result.prefix) if k.rsplit("/", 1)[-1] == CONVERSATIONS]
        if not keys:
            raise DataError(
                f"upstream stage {result.stage} ({store.uri(result.prefix)}) has no {CONVERSATIONS}: "
                "merge reads the conversations a generate stage (or an import) wrote"
            )
        files.extend(InputFile(result.stage, k, result.manifest_sha256) for k in sorted(keys))
    return files


def run(
    cfg: CorpusConfig,
    *,
    store: ArtifactStore,
    run_name: str,
    target: TargetInfo,
    inputs: list[StageResult],
    progress: ProgressFn = no_progress,
) -> StageResult:
    """Build the corpus, or return the cached result when the same inputs were merged the same way."""
    files = input_files(store, inputs)
    stage = StageDir(store, run_name, STAGE, key_of(cfg, target, inputs))
    if (cached := stage.cached_result()) is not None:
        progress(1.0, "cached")
        return cached
    with tempfile.TemporaryDirectory(prefix="aerie-merge-") as tmp:
        manifest = _build(cfg, store, stage, target, files, Path(tmp), progress)
    result = stage.finish(manifest)
    progress(1.0, manifest["figures"]["text"])
    return result


def _local(store: ArtifactStore, key: str, work: Path) -> Path:
    path = store.local_path(key)
    if path is not None and path.is_file():
        return path
    return store.get_file(key, work / "inputs" / key)


def _build(
    cfg: CorpusConfig,
    store: ArtifactStore,
    stage: StageDir,
    target: TargetInfo,
    files: list[InputFile],
    work: Path,
    progress: ProgressFn,
) -> dict[str, Any]:
    progress(0.0, "reading inputs")
    paths = [_local(store, f.key, work) for f in files]
    frames = [task_frame(p, i, store.uri(f.key)) for i, (p, f) in enumerate(zip(paths, files, strict=True))]
    rows_per_input = [int(pl.scan_parquet(p).select(pl.len()).collect().item()) for p in paths]
    total_rows = sum(rows_per_input)
    layout = Layout.plan(
        total_rows, seed=cfg.seed, eval_fraction=cfg.eval_fraction, rows_per_shard=cfg.rows_per_shard
    )
    tokenizer = target.load_tokenizer()
    spec = TemplateSpec.from_tokenizer(tokenizer, extra_kwargs=cfg.chat_template_kwargs, path=target.path)
    options = EncodeOptions(
        max_length=cfg.max_length,
        truncated_policy=cfg.truncated_policy,
        history_mismatch=cfg.history_mismatch,
        layout=layout,
    )
    spill = Spill(work / "spill", cfg.spill_mb << 20)
    quarantine_path = work / QUARANTINE
    counts: dict[str, int] = {}
    done_rows = done_tokens = 0
    progress(0.01, f"tokenizing {total_rows:,} conversations with {cfg.num_workers} worker(s)")
    with open(quarantine_path, "w") as quarantine:
        with encoder_pool(spec, options, cfg.num_workers) as encode:
            batches = pl.concat(frames, how="vertical").collect_batches(chunk_size=cfg.batch_rows)
            for result in encode(batches):
                spill.add(result.frame)
                for entry in result.quarantine:
                    quarantine.write(json.dumps(entry) + "\n")
                for name, n in result.counts.items():
                    counts[name] = counts.get(name, 0) + n
                done_rows += result.rows
                done_tokens += int(result.frame["n_tokens"].sum())
                progress(
                    0.9 * done_rows / max(total_rows, 1),
                    f"{done_rows:,}/{total_rows:,} conversations, {done_tokens:,} tokens",
                )
        spill.flush()
        shards, stats, token_counts = _write_shards(
            cfg, store, stage, spill, layout, target, work, quarantine, counts, progress
        )
    store.put_file(stage.path(QUARANTINE), quarantine_path)
    if not any(s.total("records") for s in stats.values()):
        dropped = {k.removeprefix("dropped."): v for k, v in counts.items() if k.startswith("dropped.")}
        raise DataError(
            f"no usable conversation in {total_rows:,} input rows (dropped: {dropped}); the reason for each "
            f"is in {stage.uri(QUARANTINE)}"
        )
    counts_path = work / TOKEN_COUNTS
    token_counts.frame().write_parquet(counts_path, compression="zstd")
    store.put_file(stage.path(TOKEN_COUNTS), counts_path)
    lengths = {name: s.all_lengths() for name, s in stats.items()}
    store.put_file(stage.path(LENGTH_HIST), length_histogram(lengths, cfg.max_length, work / LENGTH_HIST))
    return _manifest(cfg, target, spec, files, rows_per_input, stats, shards, counts, token_counts)


def _write_shards(
    cfg: CorpusConfig,
    store: ArtifactStore,
    stage: StageDir,
    spill: Spill,
    layout: Layout,
    target: TargetInfo,
    work: Path,
    quarantine: Any,
    counts: dict[str, int],
    progress: ProgressFn,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, SplitStats], TokenCounter]:
    """Per (split, shard): dedupe, order, write, count. Empty shards are skipped; names stay contiguous."""
    shards: dict[str, list[dict[str, Any]]] = {name: [] for name in SPLITS}
    stats = {name: SplitStats() for name in SPLITS}
    token_counts = TokenCounter(target.vocab_size)
    total = sum(layout.buckets)
    done = 0
    for split, name in enumerate(SPLITS):
        for bucket in range(layout.buckets[split]):
            done += 1
            frame = spill.shard(split, bucket)
            if frame is None:
                continue
            kept, duplicates = dedupe_and_order(frame)
            del frame
            for row in duplicates.iter_rows(named=True):
                detail = f"same messages as {row['kept_source']}/{row['kept_id']}"
                quarantine.write(
                    json.dumps(
                        {"id": row["id"], "source": row["source"], "reason": "duplicate", "detail": detail}
                    )
                    + "\n"
                )
            counts["dropped.duplicate"] = counts.get("dropped.duplicate", 0) + duplicates.height
            out = kept.select(list(CORPUS))
            del kept
            file = f"{name}-{len(shards[name]):05d}.parquet"
            local = work / file
            out.write_parquet(local, compression="zstd", row_group_size=ROW_GROUP)
            store.put_file(stage.path(file), local)
            local.unlink()
            spill.release(split, bucket)
            stats[name].add(out)
            if name == "train":
                token_counts.add(out)
            shards[name].append(
                {
                    "key": stage.path(file),
                    "file": file,
                    "rows": out.height,
                    "tokens": int(out["n_tokens"].sum()),
                    "supervised_tokens": int(out["n_supervised"].sum()),
                }
            )
            progress(0.9 + 0.1 * done / max(total, 1), f"wrote {file} ({out.height:,} rows)")
    return shards, stats, token_counts


def _manifest(
    cfg: CorpusConfig,
    target: TargetInfo,
    spec: TemplateSpec,
    files: list[InputFile],
    rows_per_input: list[int],
    stats: dict[str, SplitStats],
    shards: dict[str, list[dict[str, Any]]],
    counts: dict[str, int],
    token_counts: TokenCounter,
) -> dict[str, Any]:
    splits = {name: {**s.summary(), "shards": shards[name]} for name, s in stats.items()}
    records = sum(s["records"] for s in splits.values())
    tokens = sum(s["tokens"] for s in splits.values())
    supervised = sum(s["supervised_tokens"] for s in splits.values())
    dropped = {k.removeprefix("dropped."): v for k, v in sorted(counts.items()) if k.startswith("dropped.")}
    notes = {k: v for k, v in sorted(counts.items()) if not k.startswith("dropped.")}
    train = splits["train"]
    return {
        "target": {"name": target.name, "revision": target.revision, "vocab_size": target.vocab_size},
        "tokenizer_sha256": tokenizer_sha256(target),
        "chat_template_sha256": hashlib.sha256(spec.chat_template.encode()).hexdigest(),
        "chat_template_kwargs": cfg.chat_template_kwargs,
        "max_length": cfg.max_length,
        "seed": cfg.seed,
        "config": cfg.model_dump(mode="json"),
        "inputs": [
            {"stage": f.stage, "key": f.key, "manifest_sha256": f.manifest_sha256, "rows": n}
            for f, n in zip(files, rows_per_input, strict=True)
        ],
        "splits": splits,
        "dropped": dropped,
        "notes": notes,
        "files": {
            "quarantine": QUARANTINE,
            "token_counts": TOKEN_COUNTS,
            "length_hist": LENGTH_HIST,
        },
        "token_counts": {
            "vocab_size": len(token_counts.counts),
            "distinct_supervised_tokens": int((token_counts.counts > 0).sum()),
        },
        "figures": {
            "text": describe(records, tokens),
            "input_rows": sum(rows_per_input),
            "records": records,
            "tokens": tokens,
            "supervised_tokens": supervised,
            "supervised_fraction": round(supervised / tokens, 4) if tokens else 0.0,
            "train_records": train["records"],
            "train_tokens": train["tokens"],
            "eval_records": splits["eval"]["records"],
            "eval_tokens": splits["eval"]["tokens"],
            "dropped": sum(dropped.values()),
            "duplicates": dropped.get("duplicate", 0),
            "sources": len({src for s in splits.values() for src in s["by_source"]}),
        },
    }
