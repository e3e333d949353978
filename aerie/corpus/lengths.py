"""How long the corpus's samples, answers and reasoning are before `corpus.max_length` cuts them, and
what the cut costs: the share of supervised (and of reasoning) tokens a run keeps at its limits.

A thinking target writes thousands of reasoning tokens a turn; a sample cut at the limit is trained on
its start only, and nothing else says so. Counted per sample (after dedupe, every split) from the spill's
`n_tokens_full` / `n_supervised_full` (before the cut) and `n_reasoning` / `n_reasoning_supervised`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

COLUMNS = ("n_tokens_full", "n_supervised_full", "n_supervised", "n_reasoning", "n_reasoning_supervised")
PERCENTILES = (50, 90, 99)


def distribution(values: np.ndarray) -> dict[str, int | float]:
    """count, mean, p50/p90/p99 and max of a length array (zeros when empty)."""
    if not len(values):
        return {"count": 0, "mean": 0.0, **{f"p{p}": 0 for p in PERCENTILES}, "max": 0}
    quantiles = np.percentile(values, PERCENTILES, method="higher")
    return {
        "count": len(values),
        "mean": round(float(values.mean()), 1),
        **{f"p{p}": int(q) for p, q in zip(PERCENTILES, quantiles, strict=True)},
        "max": int(values.max()),
    }


def kept_fraction(kept: int, total: int) -> float:
    """kept / total, 1.0 when there was nothing to keep."""
    return round(kept / total, 4) if total else 1.0


@dataclass
class LengthStats:
    """Per-sample lengths of the kept rows, gathered shard by shard."""

    parts: dict[str, list[np.ndarray]] = field(default_factory=lambda: {c: [] for c in COLUMNS})

    def add(self, shard: pl.DataFrame) -> None:
        for name in COLUMNS:
            self.parts[name].append(shard[name].to_numpy().astype(np.int64))

    def column(self, name: str) -> np.ndarray:
        chunks = self.parts[name]
        return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)

    def summary(self, max_length: int) -> dict[str, Any]:
        """The manifest's `lengths`: distributions before the cut and what `max_length` keeps."""
        tokens = self.column("n_tokens_full")
        supervised_full, supervised = self.column("n_supervised_full"), self.column("n_supervised")
        reasoning, reasoning_kept = self.column("n_reasoning"), self.column("n_reasoning_supervised")
        return {
            "max_length": max_length,
            "samples": distribution(tokens),
            "supervised": distribution(supervised_full),
            "reasoning": distribution(reasoning[reasoning > 0]),
            "samples_over_max_length": int((tokens > max_length).sum()),
            "supervised_tokens_before_cut": int(supervised_full.sum()),
            "supervised_tokens_kept": int(supervised.sum()),
            "supervised_kept_fraction": kept_fraction(int(supervised.sum()), int(supervised_full.sum())),
            "reasoning_kept_fraction": kept_fraction(int(reasoning_kept.sum()), int(reasoning.sum())),
        }


def describe_lengths(lengths: dict[str, Any]) -> str:
    """One line: 'samples p50 812 / p99 9,310 / max 30,122 tokens; 3 over max_length 4,096; kept 97.1% of
    supervised, 88.0% of reasoning tokens'."""
    s = lengths["samples"]
    return (
        f"samples p50 {s['p50']:,} / p99 {s['p99']:,} / max {s['max']:,} tokens; "
        f"{lengths['samples_over_max_length']:,} over max_length {lengths['max_length']:,}; kept "
        f"{lengths['supervised_kept_fraction']:.1%} of supervised, {lengths['reasoning_kept_fraction']:.1%} "
        "of reasoning tokens"
    )
