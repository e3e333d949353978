"""Batches of conversations in, tokenized rows with loss masks out: the work each process does.

A batch is a Polars frame of `TASK_COLUMNS`. Each conversation is checked, hashed, placed (split,
shard, shuffle key), rendered with the target's chat template into one or more samples, and all
samples of the batch are tokenized in one batched call. Conversations that fail are returned as
quarantine entries, never raised: one bad row must not stop a corpus of millions.

`aerie.corpus.pool.encoder_pool` runs batches in worker processes (`aerie.corpus.worker`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from aerie.corpus.schema import SPILL
from aerie.corpus.shuffle import Layout
from aerie.corpus.template import Aligner, ChatRenderer, Encoded, Sample, TemplateSpec, make_aligner
from aerie.corpus.validate import Rejected, check_conversation, content_hash


@dataclass(frozen=True)
class EncodeOptions:
    max_length: int
    truncated_policy: str
    history_mismatch: str
    layout: Layout
    reasoning: str = "train"  # corpus.reasoning: train | drop | refuse


@dataclass
class BatchResult:
    """What one batch produced: spill rows, quarantine entries, counters and its input row count."""

    frame: pl.DataFrame
    quarantine: list[dict[str, str]] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    rows: int = 0


@dataclass
class _Pending:
    row: dict[str, Any]
    sample: Sample
    digest: bytes
    place: tuple[int, int, int]


class BatchEncoder:
    """Renders and tokenizes batches with one target's chat template and tokenizer."""

    def __init__(self, spec: TemplateSpec, options: EncodeOptions) -> None:
        self.renderer = ChatRenderer(spec)
        self.aligner: Aligner = make_aligner(spec)
        self.options = options

    def __call__(self, batch: pl.DataFrame) -> BatchResult:
        result = BatchResult(frame=_empty_frame(), rows=batch.height)
        pending: list[_Pending] = []
        for row in batch.iter_rows(named=True):
            try:
                pending.extend(self._samples(row, result.counts))
            except Rejected as rejected:
                result.quarantine.append(_entry(row, rejected.code, rejected.detail))
                result.counts[f"dropped.{rejected.code}"] += 1
        encoded = self.aligner.encode([p.sample for p in pending]) if pending else []
        result.frame = self._rows(pending, encoded, result)
        return result

    def _rows(self, pending: list[_Pending], encoded: list[Encoded], result: BatchResult) -> pl.DataFrame:
        """Truncate to max_length, drop samples left with nothing to learn, assemble the spill frame."""
        limit = self.options.max_length
        columns: dict[str, list[Any]] = {name: [] for name in (*SPILL, "split", "bucket")}
        for p, e in zip(pending, encoded, strict=True):
            ids, mask, thought = e.ids, e.mask, e.reasoning
            result.counts["boundary_tokens"] += e.straddled
            # The reasoning in the data (cut or not) and what of it is supervised once cut to max_length.
            reasoning_tokens = int(thought.sum()) + self.aligner.count(p.sample.unrendered)
            full_tokens, full_supervised = len(ids), int(mask.sum())  # before the cut (aerie.corpus.lengths)
            if len(ids) > limit:
                result.counts["samples_cut_to_max_length"] += 1
                result.counts["tokens_cut"] += len(ids) - limit
                ids, mask, thought = ids[:limit], mask[:limit], thought[:limit]
            supervised = int(mask.sum())
            reasoning_supervised = int((mask & thought).sum())
            sample_id = p.row["id"] if p.sample.whole else f"{p.row['id']}#m{p.sample.end_message}"
            if supervised == 0:
                detail = f"no assistant token within max_length={limit}"
                result.quarantine.append(_entry({**p.row, "id": sample_id}, "no_supervised_tokens", detail))
                result.counts["dropped.no_supervised_tokens"] += 1
                continue
            split, bucket, order = p.place
            for name, value in (
                ("src", p.row["src"]),
                ("sub", 0 if p.sample.whole else p.sample.end_message),
                ("hash", p.digest),
                ("order", order),
                ("id", sample_id),
                ("source", p.row["source"]),
                ("input_ids", ids),
                ("loss_mask", mask),
                ("n_tokens", len(ids)),
                ("n_supervised", supervised),
                ("n_reasoning", reasoning_tokens),
                ("n_reasoning_supervised", reasoning_supervised),
                ("n_tokens_full", full_tokens),
                ("n_supervised_full", full_supervised),
                ("split", split),
                ("bucket", bucket),
            ):
                columns[name].append(value)
        return _frame(columns)

    def _samples(self, row: dict[str, Any], counts: Counter[str]) -> list[_Pending]:
        if row["id"] is None or row["source"] is None:
            raise Rejected("null_field", "the row has no id or no source")
        checked = check_conversation(
            row["messages"],
            truncated=row["truncated"],
            finish_reasons=row["finish_reasons"],
            truncated_policy=self.options.truncated_policy,
            reasoning_policy=self.options.reasoning,
            parser=self.renderer.parser,
        )
        counts.update(checked.notes)
        counts["trailing_user_turns_trimmed"] += checked.trimmed
        counts["truncated_turns"] += len(checked.truncated_turns)
        try:
            samples, notes = self.renderer.samples(
                checked.messages, checked.truncated_turns, self.options.history_mismatch
            )
        except Rejected:
            raise
        except Exception as exc:  # noqa: BLE001 - a template's raise_exception, or any error it hits on this row
            raise Rejected("template_error", f"the chat template refused it: {str(exc)[:300]}") from exc
        counts.update(notes)
        digest = content_hash(checked.messages, checked.truncated_turns)
        place = self.options.layout.place(digest)
        slim = {"src": row["src"], "id": row["id"], "source": row["source"]}
        return [_Pending(slim, s, digest, place) for s in samples]


def _entry(row: dict[str, Any], code: str, detail: str) -> dict[str, str]:
    return {"id": str(row.get("id")), "source": str(row.get("source")), "reason": code, "detail": detail}


def _empty_frame() -> pl.DataFrame:
    return pl.DataFrame(schema={**SPILL, "split": pl.UInt8(), "bucket": pl.UInt32()})


def _frame(columns: dict[str, list[Any]]) -> pl.DataFrame:
    if not columns["id"]:
        return _empty_frame()
    schema = {**SPILL, "split": pl.UInt8(), "bucket": pl.UInt32()}
    series = {}
    for name, values in columns.items():
        if isinstance(schema[name], pl.List):
            series[name] = _list_series(name, values, schema[name])
        else:
            series[name] = pl.Series(name, values, dtype=schema[name])
    return pl.DataFrame(series)


def _list_series(name: str, arrays: list[np.ndarray], dtype: pl.DataType) -> pl.Series:
    """A list column from numpy arrays without a Python int per token. Polars reads equal-length arrays
    as a 2-D block (an Array column), so that case is converted back to a list column."""
    series = pl.Series(name, arrays)
    if isinstance(series.dtype, pl.Array):
        series = series.arr.to_list()
    return series.cast(dtype)
