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
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import polars as pl

from aerie.corpus.config import EXECUTION_FIELDS, CorpusConfig
from aerie.corpus.encoding import EncodeOptions
from aerie.corpus.lengths import LengthStats, describe_lengths
from aerie.corpus.pool import encoder_pool
from aerie.corpus.schema import CORPUS, task_frame
from aerie.corpus.shuffle import SPLITS, Layout, Spill, dedupe_and_order
from aerie.corpus.stats import SplitStats, TokenCounter, describe, length_histogram
from aerie.corpus.template import TemplateSpec
from aerie.diskspace import writing
from aerie.errors import ConfigError, DataError
from aerie.manifest import StageDir, StageResult, stage_key
from aerie.progress import ProgressFn
from aerie.reasoning import ReasoningParser, parser_for, reasoning_warning
from aerie.stage import WorkContext
from aerie.store import ArtifactStore
from aerie.targets import TargetInfo
from aerie.workdirs import work_dir

STAGE = "merge"
CONVERSATIONS = "conversations.parquet"
TOKEN_COUNTS = "token_counts.parquet"
QUARANTINE = "quarantine.jsonl"
LENGTH_HIST = "length_hist.png"
ROW_GROUP = 2048  # rows per Parquet row group: what a streaming reader holds at once

log = logging.getLogger(__name__)

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


def template_override(cfg: CorpusConfig) -> str | None:
    """The text of `corpus.chat_template`, or None when the target's own template is used."""
    if cfg.chat_template is None:
        return None
    path = Path(cfg.chat_template).expanduser()
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"corpus.chat_template: cannot read {path}: {exc}") from exc
    if not text.strip():
        raise ConfigError(f"corpus.chat_template: {path} is empty")
    return text


def template_sha256(cfg: CorpusConfig, target: TargetInfo) -> str:
    """The hash of the template the corpus is rendered with: the override's, else the target's."""
    override = template_override(cfg)
    return target.chat_template_sha256 if override is None else hashlib.sha256(override.encode()).hexdigest()


def reasoning_parser(cfg: CorpusConfig, target: TargetInfo, template: str) -> ReasoningParser | None:
    return parser_for(target.geometry.architecture, template, cfg.reasoning_parser)


def key_of(cfg: CorpusConfig, target: TargetInfo, inputs: list[StageResult]) -> str:
    # The override's path is not content (its hash is): moving the file keeps the cache.
    content = cfg.model_dump(mode="json", exclude={*EXECUTION_FIELDS, "chat_template"})
    config = {
        "corpus": content,
        "tokenizer": tokenizer_sha256(target),
        "chat_template": template_sha256(cfg, target),
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


def run(cfg: CorpusConfig, ctx: WorkContext, *, inputs: list[StageResult]) -> StageResult:
    """Build the corpus into `ctx.stage_dir` (keyed by `key_of` over these inputs), or return the cached
    result when the same inputs were merged the same way."""
    stage_dir, progress = ctx.stage_dir, ctx.progress
    files = input_files(stage_dir.store, inputs)
    if (cached := stage_dir.cached_result()) is not None:
        progress(1.0, "cached")
        return cached
    with work_dir("aerie-merge-") as tmp:
        manifest = _build(cfg, stage_dir.store, stage_dir, ctx.target, files, Path(tmp), progress)
    result = stage_dir.finish(manifest)
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
    stage_dir: StageDir,
    target: TargetInfo,
    files: list[InputFile],
    work: Path,
    progress: ProgressFn,
) -> dict[str, Any]:
    progress(0.0, "reading inputs")
    paths = [_local(store, f.key, work) for f in files]
    frames = [task_frame(p, i, store.uri(f.key)) for i, (p, f) in enumerate(zip(paths, files, strict=True))]
    rows_per_input = [int(pl.scan_parquet(p).select(pl.len()).collect().item()) for p in paths]
    layout = Layout.plan(
        sum(rows_per_input), seed=cfg.seed, eval_fraction=cfg.eval_fraction, rows_per_shard=cfg.rows_per_shard
    )
    tokenizer = target.load_tokenizer()
    override = template_override(cfg)
    spec = TemplateSpec.from_tokenizer(
        tokenizer, extra_kwargs=cfg.chat_template_kwargs, target=target, template=override
    )
    spec.parser = reasoning_parser(cfg, target, spec.chat_template)
    build = _Build(cfg, store, stage_dir, work, progress, TokenCounter(target.geometry.vocab_size))
    with open(work / QUARANTINE, "w") as build.quarantine:
        spill = build.tokenize(pl.concat(frames, how="vertical"), spec, layout, sum(rows_per_input))
        build.write_shards(spill, layout)
    build.upload_reports(sum(rows_per_input))
    return _manifest(cfg, target, spec, files, rows_per_input, build)


class _Build:
    """The state of one corpus build: counters, quarantine file, per-split totals and shard list."""

    quarantine: IO[str]

    def __init__(
        self,
        cfg: CorpusConfig,
        store: ArtifactStore,
        stage_dir: StageDir,
        work: Path,
        progress: ProgressFn,
        token_counts: TokenCounter,
    ) -> None:
        self.cfg, self.store, self.stage_dir, self.work, self.progress = cfg, store, stage_dir, work, progress
        self.token_counts = token_counts
        self.counts: Counter[str] = Counter()
        self.stats = {name: SplitStats() for name in SPLITS}
        self.lengths = LengthStats()
        self.shards: dict[str, list[dict[str, Any]]] = {name: [] for name in SPLITS}

    def quarantine_entry(self, entry: dict[str, str]) -> None:
        with writing(self.work / QUARANTINE, DataError):
            self.quarantine.write(json.dumps(entry) + "\n")

    def tokenize(
        self, conversations: pl.LazyFrame, spec: TemplateSpec, layout: Layout, total_rows: int
    ) -> Spill:
        """Stream batches through the workers into the spill (90% of the progress bar)."""
        cfg = self.cfg
        options = EncodeOptions(
            cfg.max_length, cfg.truncated_policy, cfg.history_mismatch, layout, reasoning=cfg.reasoning
        )
        spill = Spill(self.work / "spill", cfg.spill_mb << 20)
        done_rows = done_tokens = 0
        self.progress(0.01, f"tokenizing {total_rows:,} conversations with {cfg.num_workers} worker(s)")
        with encoder_pool(spec, options, cfg.num_workers) as encode:
            for result in encode(conversations.collect_batches(chunk_size=cfg.batch_rows)):
                spill.add(result.frame)
                for entry in result.quarantine:
                    self.quarantine_entry(entry)
                self.counts.update(result.counts)
                done_rows += result.rows
                done_tokens += int(result.frame["n_tokens"].sum())
                message = f"{done_rows:,}/{total_rows:,} conversations, {done_tokens:,} tokens"
                self.progress(0.9 * done_rows / max(total_rows, 1), message)
        spill.flush()
        return spill

    def write_shards(self, spill: Spill, layout: Layout) -> None:
        """Per (split, shard): dedupe, order, write, count. Empty shards are skipped; names stay contiguous."""
        total, done = sum(layout.buckets), 0
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
                    self.quarantine_entry(
                        {"id": row["id"], "source": row["source"], "reason": "duplicate", "detail": detail}
                    )
                self.counts["dropped.duplicate"] += duplicates.height
                self.counts["reasoning_tokens"] += int(kept["n_reasoning"].sum())
                self.counts["reasoning_tokens_supervised"] += int(kept["n_reasoning_supervised"].sum())
                self.lengths.add(kept)
                file = self._write(name, kept.select(list(CORPUS)))
                spill.release(split, bucket)
                self.progress(0.9 + 0.1 * done / max(total, 1), f"wrote {file}")

    def _write(self, split: str, out: pl.DataFrame) -> str:
        file = f"{split}-{len(self.shards[split]):05d}.parquet"
        local = self.work / file
        with writing(local, DataError):
            out.write_parquet(local, compression="zstd", row_group_size=ROW_GROUP)
        self.store.put_file(self.stage_dir.path(file), local)
        local.unlink()
        self.stats[split].add(out)
        if split == "train":
            self.token_counts.add(out)
        self.shards[split].append(
            {
                "key": self.stage_dir.path(file),
                "file": file,
                "rows": out.height,
                "tokens": int(out["n_tokens"].sum()),
                "supervised_tokens": int(out["n_supervised"].sum()),
            }
        )
        return file

    def dropped(self) -> dict[str, int]:
        return {
            k.removeprefix("dropped."): v for k, v in sorted(self.counts.items()) if k.startswith("dropped.")
        }

    def upload_reports(self, total_rows: int) -> None:
        """quarantine.jsonl always (it says why rows were dropped, even when nothing is left), then the
        token counts and the length histogram."""
        self.store.put_file(self.stage_dir.path(QUARANTINE), self.work / QUARANTINE)
        if not any(s.total("records") for s in self.stats.values()):
            raise DataError(
                f"no usable conversation in {total_rows:,} input rows (dropped: {self.dropped()}); the reason "
                f"for each is in {self.stage_dir.uri(QUARANTINE)}"
            )
        counts_path = self.work / TOKEN_COUNTS
        with writing(counts_path, DataError):
            self.token_counts.frame().write_parquet(counts_path, compression="zstd")
        self.store.put_file(self.stage_dir.path(TOKEN_COUNTS), counts_path)
        lengths = {name: s.all_lengths() for name, s in self.stats.items()}
        plot = length_histogram(lengths, self.cfg.max_length, self.work / LENGTH_HIST)
        self.store.put_file(self.stage_dir.path(LENGTH_HIST), plot)


def _manifest(
    cfg: CorpusConfig,
    target: TargetInfo,
    spec: TemplateSpec,
    files: list[InputFile],
    rows_per_input: list[int],
    build: _Build,
) -> dict[str, Any]:
    splits = {name: {**s.summary(), "shards": build.shards[name]} for name, s in build.stats.items()}
    token_counts = build.token_counts
    records = sum(s["records"] for s in splits.values())
    tokens = sum(s["tokens"] for s in splits.values())
    supervised = sum(s["supervised_tokens"] for s in splits.values())
    dropped = build.dropped()
    reasoning = {
        name: build.counts.pop(name, 0) for name in ("reasoning_tokens", "reasoning_tokens_supervised")
    }
    notes = {k: v for k, v in sorted(build.counts.items()) if not k.startswith("dropped.")}
    train = splits["train"]
    warning = reasoning_warning(
        reasoning["reasoning_tokens"], reasoning["reasoning_tokens_supervised"], cfg.reasoning
    )
    if warning:
        log.warning("merge: %s", warning)
    lengths = build.lengths.summary(cfg.max_length)
    log.info("merge: %s", describe_lengths(lengths))
    return {
        "target": {
            "name": target.name,
            "revision": target.revision,
            "vocab_size": target.geometry.vocab_size,
        },
        "tokenizer_sha256": tokenizer_sha256(target),
        "chat_template_sha256": hashlib.sha256(spec.chat_template.encode()).hexdigest(),
        "chat_template_override": cfg.chat_template,
        "chat_template_kwargs": cfg.chat_template_kwargs,
        "reasoning": {
            "policy": cfg.reasoning,
            "parser": spec.parser.name if spec.parser else None,
            **reasoning,
            "warning": warning,
        },
        "max_length": cfg.max_length,
        "lengths": lengths,
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
            **reasoning,
            "samples_over_max_length": lengths["samples_over_max_length"],
            "supervised_kept_fraction": lengths["supervised_kept_fraction"],
            "reasoning_kept_fraction": lengths["reasoning_kept_fraction"],
            "sample_tokens_p99": lengths["samples"]["p99"],
            "reasoning_tokens_p99": lengths["reasoning"]["p99"],
        },
    }
