"""Configuration of the merge/corpus stage."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from aerie.configbase import StrictModel
from aerie.reasoning import parser_named

# Fields that change how fast the corpus is built, never what it contains: left out of the stage key.
EXECUTION_FIELDS = frozenset({"num_workers", "batch_rows", "spill_mb"})


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
        "keep",
        description="Conversations whose generation hit max_tokens: keep = supervise the text that was "
        "generated but not the end-of-turn the model never produced; drop = quarantine them.",
    )
    history_mismatch: Literal["split", "mask"] = Field(
        "split",
        description="When the template renders an earlier assistant turn differently as history (e.g. it "
        "strips old reasoning): split = one extra sample per such turn, rendered as the server saw it; "
        "mask = leave that turn unsupervised.",
    )
    reasoning: Literal["train", "drop", "refuse"] = Field(
        "train",
        description="A thinking model's reasoning (the `reasoning` field of a turn, or `<think>` inline in "
        "its content): train = supervised like the answer, each assistant turn rendered the way the target "
        "wrote it, even where the template blanks it; drop = removed, only answers are trained on; refuse "
        "= a conversation that carries reasoning is quarantined.",
    )
    reasoning_parser: str = Field(
        "auto",
        description="How reasoning inline in a turn's content is split from the answer, by SGLang's "
        "--reasoning-parser names (qwen3, deepseek-r1, kimi_k2, ...): auto = the target's family, read from "
        "its architecture and chat template; none = content is never split.",
    )
    chat_template: str | None = Field(
        None,
        description="A chat template file (Jinja) used instead of the target's own, e.g. a corrected one; "
        "its hash is part of the stage key. None = the target's template.",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables for the chat template (e.g. {'enable_thinking': true}), as the "
        "serving engine passes them.",
    )
    rows_per_shard: int = Field(20_000, ge=1, description="Rows per output Parquet shard (about).")
    num_workers: int = Field(2, ge=1, description="Processes tokenizing in parallel; 1 = in process.")
    batch_rows: int = Field(256, ge=1, description="Conversations per tokenization task.")
    spill_mb: int = Field(
        256, ge=8, description="Tokenized rows buffered in memory before they are spilled to disk (MiB)."
    )

    @field_validator("reasoning_parser")
    @classmethod
    def _known_parser(cls, value: str) -> str:
        if value not in ("auto", "none"):
            parser_named(value)  # raises, naming the parsers aerie knows
        return value
