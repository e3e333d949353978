"""The draft vocabulary: which target tokens the drafter can propose, and the maps SGLang reads.

The draft lm_head has Vd rows instead of V; SGLang maps a draft id back with `d2t` (target = draft +
d2t[draft], its `hot_token_id`), and the trainer restricts the teacher to the same rows with `t2d`.
Selection follows SpecForge (`generate_vocab_mapping_file`, PR #76): the Vd most frequent supervised
(assistant) tokens, sorted by id; when the data has fewer distinct tokens, pad with the smallest unused ids.
Coverage — the share of supervised target tokens inside the draft vocab — bounds how often a drafted
token can be right at all (a token outside it is a guaranteed rejection).
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from aerie.errors import DataError, ObjectNotFoundError
from aerie.manifest import StageResult, load_manifest
from aerie.store import ArtifactStore

if TYPE_CHECKING:
    import polars as pl

TOKEN_COUNTS = "token_counts.parquet"


@dataclass(frozen=True)
class VocabMap:
    """used [Vd] int64 target ids (ascending); d2t [Vd] int64; t2d [V] bool."""

    used: Tensor
    d2t: Tensor
    t2d: Tensor
    coverage: float  # share of supervised tokens whose id is in `used`
    distinct_tokens: int  # distinct token ids seen in supervised spans
    supervised_tokens: int

    @property
    def draft_vocab_size(self) -> int:
        return int(self.used.numel())

    def figures(self) -> dict[str, float | int]:
        return {
            "draft_vocab_size": self.draft_vocab_size,
            "vocab_coverage": round(self.coverage, 6),
            "distinct_supervised_tokens": self.distinct_tokens,
            "supervised_tokens": self.supervised_tokens,
        }


def build_vocab_map(counts: Tensor, draft_vocab_size: int) -> VocabMap:
    """counts [V] int64 (supervised-token frequency per target id) -> the top-Vd map, Vd capped at V."""
    vocab_size = counts.numel()
    vd = min(draft_vocab_size, vocab_size)
    counts = counts.to(torch.int64)
    # Sort by count descending, ties by id ascending: a stable sort of ids already in id order does it.
    order = torch.sort(-counts, stable=True).indices
    seen = int((counts > 0).sum())
    top = order[: min(vd, seen)]
    if top.numel() < vd:  # fewer distinct tokens than Vd: pad with the smallest unused ids
        unused = torch.ones(vocab_size, dtype=torch.bool)
        unused[top] = False
        top = torch.cat([top, unused.nonzero().flatten()[: vd - top.numel()]])
    used = torch.sort(top).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    total = int(counts.sum())
    return VocabMap(
        used=used,
        d2t=used - torch.arange(vd),
        t2d=t2d,
        coverage=float(counts[used].sum()) / total if total else 0.0,
        distinct_tokens=seen,
        supervised_tokens=total,
    )


def coverage_by_size(
    counts: Tensor, token_ids: Tensor, draft_vocab_size: int, sizes: Iterable[int] = ()
) -> dict[int, float]:
    """The share of `token_ids` (e.g. the target's answers) that a draft vocab built from `counts` would
    hold, at this drafter's size Vd, half and twice it, the whole vocab V and any `sizes` up to V: what a
    larger or smaller draft vocab would give back, since a token outside it is a guaranteed rejection."""
    vocab_size = counts.numel()
    sizes = sorted(
        {max(1, draft_vocab_size // 2), draft_vocab_size, 2 * draft_vocab_size, vocab_size, *sizes}
    )
    ids = token_ids.to(torch.int64)
    return {
        size: float(build_vocab_map(counts, size).t2d[ids].float().mean()) if ids.numel() else 0.0
        for size in sizes
        if size <= vocab_size
    }


def counts_from_table(token_ids: Tensor, counts: Tensor, vocab_size: int) -> Tensor:
    """A (token_id, count) table -> dense counts [V]. The corpus lists every id of its tokenizer, which may
    exceed the model's vocab (added tokens): those rows are dropped if never seen, a data error if seen."""
    token_ids, counts = token_ids.to(torch.int64), counts.to(torch.int64)
    outside = (token_ids < 0) | (token_ids >= vocab_size)
    if bool((counts[outside] > 0).any()):
        bad = token_ids[outside & (counts > 0)]
        raise DataError(
            f"{bad.numel()} supervised token ids lie outside the target vocab of {vocab_size} "
            f"(e.g. {int(bad[0])}): the corpus was tokenized for another model"
        )
    token_ids, counts = token_ids[~outside], counts[~outside]
    dense = torch.zeros(vocab_size, dtype=torch.int64)
    dense.index_add_(0, token_ids.to(torch.int64), counts.to(torch.int64))
    return dense


def load_token_counts(store: ArtifactStore, corpus: StageResult, vocab_size: int) -> Tensor:
    """Dense counts [V] from the corpus stage's `token_counts.parquet` (token_id int32, count int64)."""
    import polars as pl

    manifest = load_manifest(store, corpus.prefix)
    key = f"{corpus.prefix}/{manifest.get('files', {}).get('token_counts', TOKEN_COUNTS)}"
    try:
        frame = pl.read_parquet(io.BytesIO(store.get_bytes(key)))
    except ObjectNotFoundError as exc:
        raise DataError(f"the corpus stage wrote no {TOKEN_COUNTS} at {store.uri(key)}") from exc
    return counts_from_frame(frame, vocab_size, store.uri(key))


def counts_from_frame(frame: pl.DataFrame, vocab_size: int, where: str) -> Tensor:
    """A read `token_counts.parquet` (token_id, count) -> dense counts [V]; `where` names it in errors."""
    if not {"token_id", "count"} <= set(frame.columns):
        raise DataError(f"{where} needs columns token_id and count, has {frame.columns}")
    ids = torch.from_numpy(frame["token_id"].to_numpy().astype("int64"))
    counts = torch.from_numpy(frame["count"].to_numpy().astype("int64"))
    return counts_from_table(ids, counts, vocab_size)
