"""Configuration of the merge/corpus stage."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from aerie.configbase import StrictModel


class CorpusConfig(StrictModel):
    """Merge, dedupe, shuffle and tokenize conversations into a training corpus."""

    max_length: int = Field(
        2048, ge=16, description="Tokens per sample after the chat template; longer is truncated."
    )
    eval_fraction: float = Field(
        0.02, ge=0.0, lt=1.0, description="Share of conversations held out for evaluation."
    )
    seed: int = Field(0, description="Seed of the deterministic shuffle and split.")
    truncated_policy: Literal["keep", "drop"] = Field(
        "keep", description="What to do with conversations whose generation hit max_tokens."
    )
    rows_per_shard: int = Field(50_000, ge=1, description="Rows per output Parquet shard.")
    num_workers: int = Field(2, ge=1, description="Processes tokenizing in parallel.")
