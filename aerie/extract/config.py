"""Configuration of the hidden-state extraction stage."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from aerie.configbase import StrictModel

SPLITS: tuple[Literal["train", "eval"], ...] = ("train", "eval")


class ExtractConfig(StrictModel):
    """Prefill the corpus through the target and pack hidden states into shards."""

    storage_dtype: Literal["bf16", "fp8"] = Field(
        "bf16", description="bf16, or fp8 e4m3 with per-token scales."
    )
    shard_bytes: int = Field(1 << 30, ge=1 << 16, description="Target size of one shard file.")
    batch_tokens: int = Field(16384, ge=64, description="Tokens per /generate request (many sequences each).")
    requests_in_flight: int = Field(2, ge=1, description="Concurrent /generate requests per server.")
    num_servers: int = Field(
        1, ge=1, description="Servers extracting in parallel, each a slice of the corpus."
    )
    max_restarts: int = Field(2, ge=0, description="Restarts of a server that dies mid-extraction.")
    delete_local_after_upload: bool = Field(
        False, description="Delete a shard's local copy after a verified upload."
    )
    work_dir: str | None = Field(None, description="Local dir for dumps and shards; None = a temp dir.")
    disk_margin: float = Field(1.2, ge=1.0, description="Preflight asks for estimated bytes x this margin.")
    splits: list[Literal["train", "eval"]] = Field(
        default_factory=lambda: list(SPLITS), description="Corpus splits to extract."
    )
