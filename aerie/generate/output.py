"""`conversations.parquet`: the generation stage's output, read by the corpus stage by this schema."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import polars as pl

from aerie.errors import SchemaError

MESSAGE = pl.Struct({"role": pl.String, "content": pl.String, "reasoning": pl.String})

_COLUMNS: dict[str, pl.DataType] = {
    "id": pl.String(),
    "source": pl.String(),
    "messages": pl.List(MESSAGE),
    "finish_reasons": pl.List(pl.String()),  # one per regenerated assistant turn; [] when kept as is
    "prompt_tokens": pl.Int64(),
    "completion_tokens": pl.Int64(),
    "cost": pl.Float64(),  # null when the endpoint reports no cost (local servers)
    "truncated": pl.Boolean(),  # some assistant turn stopped at max_tokens
    "params_hash": pl.String(),
}
SCHEMA = pl.Schema(_COLUMNS)


def to_row(record: dict[str, Any]) -> dict[str, Any]:
    """A journal record as a Parquet row (journal-only fields such as `requests` dropped)."""
    row = {name: record.get(name) for name in SCHEMA.names() if name != "truncated"}
    row["truncated"] = any(reason == "length" for reason in record["finish_reasons"])
    return row


def write_conversations(records: Iterable[dict[str, Any]], path: str | Path) -> int:
    """Write rows in the given order; returns the row count."""
    frame = pl.DataFrame([to_row(r) for r in records], schema=SCHEMA)
    frame.write_parquet(path, compression="zstd", statistics=True)
    return frame.height


def read_conversations(path: str | Path) -> pl.DataFrame:
    """Read a `conversations.parquet`, refusing a file whose columns differ from `SCHEMA`."""
    frame = pl.read_parquet(path)
    if frame.schema != SCHEMA:
        raise SchemaError(f"{path}: columns {dict(frame.schema)} do not match {dict(SCHEMA)}")
    return frame
