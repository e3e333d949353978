"""The tables the corpus stage reads and writes, and the checks that name the wrong column.

Input: `conversations.parquet` as the generation stage writes it (`id, source, messages, finish_reasons,
truncated, ...`). Raw datasets that already carry assistant turns are converted to the same rows with
`conversations_frame`. Only `id`, `source` and `messages` are required; `truncated` and `finish_reasons`
are read when present, other columns (usage, cost, params_hash) are ignored.

Output: shards of `id, source, input_ids, loss_mask, n_tokens, n_supervised`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import polars as pl

from aerie.conversation import Conversation
from aerie.errors import SchemaError

MESSAGE = pl.Struct({"role": pl.String, "content": pl.String, "reasoning": pl.String})

# The generation stage's full schema; `conversations_frame` writes it so raw datasets look the same.
CONVERSATIONS: dict[str, pl.DataType] = {
    "id": pl.String(),
    "source": pl.String(),
    "messages": pl.List(MESSAGE),
    "finish_reasons": pl.List(pl.String()),
    "prompt_tokens": pl.Int64(),
    "completion_tokens": pl.Int64(),
    "cost": pl.Float64(),
    "truncated": pl.Boolean(),
    "params_hash": pl.String(),
}

# What one tokenization task receives: the columns the checks and the template need.
TASK_COLUMNS = ("src", "id", "source", "messages", "truncated", "finish_reasons")

CORPUS: dict[str, pl.DataType] = {
    "id": pl.String(),
    "source": pl.String(),
    "input_ids": pl.List(pl.Int32()),
    "loss_mask": pl.List(pl.UInt8()),
    "n_tokens": pl.Int32(),
    "n_supervised": pl.Int32(),
}

# Tokenized rows between the workers and the final shards: the corpus plus the keys that dedupe and order it.
SPILL: dict[str, pl.DataType] = {
    "src": pl.Int64(),  # input file index << 40 | row index: "first occurrence" for dedupe
    "sub": pl.Int32(),  # 0 = the whole conversation; k > 0 = extra sample ending at message k
    "hash": pl.Binary(),  # content hash of the messages (dedupe key)
    "order": pl.UInt64(),  # shuffle key
    "n_reasoning": pl.Int32(),  # reasoning tokens in the data the sample carries (counted, not written)
    "n_reasoning_supervised": pl.Int32(),  # of them, supervised within max_length
    "n_tokens_full": pl.Int32(),  # the sample's tokens before the cut to max_length
    "n_supervised_full": pl.Int32(),  # its supervised tokens before the cut
    **CORPUS,
}

_STRING_LIKE = (pl.String, pl.Categorical, pl.Enum)


def _is_string(dtype: Any) -> bool:
    return isinstance(dtype, _STRING_LIKE) or dtype == pl.Null


def check_conversations_schema(schema: pl.Schema, where: str) -> None:
    """Raise `SchemaError` naming the first column (or message field) that does not match the contract."""
    for name in ("id", "source"):
        if name not in schema:
            raise SchemaError(f"{where}: column {name!r} is missing (columns: {', '.join(schema.names())})")
        if not _is_string(schema[name]):
            raise SchemaError(f"{where}: column {name!r} is {schema[name]}, expected String")
    if "messages" not in schema:
        raise SchemaError(f"{where}: column 'messages' is missing (columns: {', '.join(schema.names())})")
    messages = schema["messages"]
    if not isinstance(messages, pl.List) or not isinstance(messages.inner, pl.Struct):
        raise SchemaError(
            f"{where}: column 'messages' is {messages}, expected List(Struct(role: String, content: String, "
            "reasoning: String))"
        )
    fields = {f.name: f.dtype for f in messages.inner.fields}
    for name in ("role", "content"):
        if name not in fields:
            raise SchemaError(
                f"{where}: column 'messages' has no field {name!r} (fields: {', '.join(fields)})"
            )
    for name in ("role", "content", "reasoning"):
        if name in fields and not _is_string(fields[name]):
            raise SchemaError(f"{where}: field 'messages.{name}' is {fields[name]}, expected String")
    if "truncated" in schema and schema["truncated"] not in (pl.Boolean, pl.Null):
        raise SchemaError(f"{where}: column 'truncated' is {schema['truncated']}, expected Boolean")
    if "finish_reasons" in schema:
        fr = schema["finish_reasons"]
        if fr != pl.Null and not (isinstance(fr, pl.List) and _is_string(fr.inner)):
            raise SchemaError(f"{where}: column 'finish_reasons' is {fr}, expected List(String)")


def task_frame(path: str | Path, index: int, where: str) -> pl.LazyFrame:
    """One input as a lazy frame of `TASK_COLUMNS`, whatever optional columns it lacks.

    `src` numbers rows globally (input index << 40 | row), so "first occurrence" is well defined when
    duplicates are dropped, whatever order the batches come back in.
    """
    lazy = pl.scan_parquet(path, row_index_name="__row")
    try:
        schema = lazy.collect_schema()
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise SchemaError(f"{where}: not a readable Parquet file: {exc}") from exc
    check_conversations_schema(schema, where)
    fields = {f.name for f in cast(pl.Struct, cast(pl.List, schema["messages"]).inner).fields}
    message = pl.struct(
        pl.element().struct.field("role").cast(pl.String).alias("role"),
        pl.element().struct.field("content").cast(pl.String).alias("content"),
        (
            pl.element().struct.field("reasoning").cast(pl.String)
            if "reasoning" in fields
            else pl.lit(None, pl.String)
        ).alias("reasoning"),
    )
    return lazy.select(
        (pl.lit(index << 40, pl.Int64) + pl.col("__row").cast(pl.Int64)).alias("src"),
        pl.col("id").cast(pl.String),
        pl.col("source").cast(pl.String),
        pl.col("messages").list.eval(message),
        (pl.col("truncated").cast(pl.Boolean) if "truncated" in schema else pl.lit(False)).alias("truncated"),
        (
            pl.col("finish_reasons").cast(pl.List(pl.String))
            if "finish_reasons" in schema
            else pl.lit([], pl.List(pl.String))
        ).alias("finish_reasons"),
    )


def conversations_frame(conversations: Iterable[Conversation]) -> pl.DataFrame:
    """Raw conversations (a dataset that already has assistant turns) as `conversations.parquet` rows."""
    rows = [
        {
            "id": c.id,
            "source": c.source,
            "messages": [m.model_dump() for m in c.messages],
            "finish_reasons": [],
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "cost": None,
            "truncated": False,
            "params_hash": "",
        }
        for c in conversations
    ]
    return pl.DataFrame(rows, schema=CONVERSATIONS)
