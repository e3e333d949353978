"""Corpus statistics for the manifest and the report: records and tokens per source and split, the
supervised fraction, sample lengths (a histogram PNG) and the frequency of every token in the
assistant spans of the train split (the drafter's vocabulary map is built from it)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from aerie.diskspace import writing
from aerie.errors import DataError


@dataclass
class SplitStats:
    """Running totals of one split, updated shard by shard."""

    by_source: dict[str, dict[str, int]] = field(
        default_factory=lambda: defaultdict(lambda: {"records": 0, "tokens": 0, "supervised_tokens": 0})
    )
    lengths: list[np.ndarray] = field(default_factory=list)

    def add(self, shard: pl.DataFrame) -> None:
        sums = shard.group_by("source").agg(
            records=pl.len(), tokens=pl.col("n_tokens").sum(), supervised_tokens=pl.col("n_supervised").sum()
        )
        for row in sums.iter_rows(named=True):
            entry = self.by_source[row["source"]]
            for name in ("records", "tokens", "supervised_tokens"):
                entry[name] += int(row[name])
        self.lengths.append(shard["n_tokens"].to_numpy())

    def total(self, name: str) -> int:
        return sum(v[name] for v in self.by_source.values())

    def summary(self) -> dict[str, Any]:
        records, tokens, supervised = (
            self.total("records"),
            self.total("tokens"),
            self.total("supervised_tokens"),
        )
        lengths = self.all_lengths()
        return {
            "records": records,
            "tokens": tokens,
            "supervised_tokens": supervised,
            "supervised_fraction": round(supervised / tokens, 4) if tokens else 0.0,
            "mean_length": round(float(lengths.mean()), 1) if len(lengths) else 0.0,
            "max_length_seen": int(lengths.max()) if len(lengths) else 0,
            "text": describe(records, tokens),
            "by_source": {
                src: {**v, "text": describe(v["records"], v["tokens"])}
                for src, v in sorted(self.by_source.items())
            },
        }

    def all_lengths(self) -> np.ndarray:
        return np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int32)


class TokenCounter:
    """Counts of every token id under the loss mask."""

    def __init__(self, vocab_size: int) -> None:
        self.counts = np.zeros(vocab_size, dtype=np.int64)

    def add(self, shard: pl.DataFrame) -> None:
        flat = shard.select(pl.col("input_ids").explode(), pl.col("loss_mask").explode())
        ids = flat.filter(pl.col("loss_mask") == 1)["input_ids"].to_numpy()
        if len(ids) and int(ids.max()) >= len(self.counts):
            # The tokenizer has added tokens past the model's vocab_size: grow rather than drop them.
            self.counts = np.pad(self.counts, (0, int(ids.max()) + 1 - len(self.counts)))
        self.counts += np.bincount(ids, minlength=len(self.counts))

    def frame(self) -> pl.DataFrame:
        """Every token id of the vocabulary, with its count (zeros included, so the table is the vocab)."""
        return pl.DataFrame(
            {
                "token_id": np.arange(len(self.counts), dtype=np.int32),
                "count": self.counts,
            }
        )


def describe(records: int, tokens: int) -> str:
    """'37,312 records, 87.8M tokens'."""
    if tokens >= 1e9:
        size = f"{tokens / 1e9:.1f}B"
    elif tokens >= 1e6:
        size = f"{tokens / 1e6:.1f}M"
    elif tokens >= 1e3:
        size = f"{tokens / 1e3:.1f}K"
    else:
        size = str(tokens)
    return f"{records:,} records, {size} tokens"


def length_histogram(splits: dict[str, np.ndarray], max_length: int, path: Path) -> Path:
    """A PNG of sample lengths per split, with the truncation limit marked."""
    # The object API renders with Agg and leaves pyplot's global backend alone.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    ax = fig.subplots()
    bins = np.linspace(0, max_length, 65)
    for name, lengths in splits.items():
        if len(lengths):
            ax.hist(lengths, bins=bins.tolist(), alpha=0.6, label=f"{name} ({len(lengths):,} samples)")
    ax.axvline(max_length, color="black", linestyle="--", linewidth=1, label=f"max_length {max_length}")
    ax.set_xlabel("tokens per sample (after the chat template)")
    ax.set_ylabel("samples")
    ax.set_title("Corpus sample lengths")
    ax.legend()
    fig.tight_layout()
    with writing(path, DataError):
        fig.savefig(path)
    return path
