"""Shared parts of the online-training tests: a tiny real Llama target served by the reference server
(a real process), a small corpus of its token ids in the merge stage's contract (with token counts),
and the offline path (the extract stage's shards) to compare an online training with."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import polars as pl
import torch
from safetensors.torch import load_file

from aerie.extract import work as extract_work
from aerie.extract.config import ExtractConfig
from aerie.manifest import StageResult
from aerie.serving import ServerConfig
from aerie.store import ArtifactStore
from aerie.targets import TargetInfo
from aerie.train import work
from aerie.train.config import TrainConfig
from tests.conftest import free_port
from tests.extract_support import write_corpus
from tests.stage_work import staged

extract = staged("extract", extract_work.run)
train = staged("train", work.run)

RUN = "online"


def random_rows(vocab: int, n: int, seed: int, lo: int = 12, hi: int = 48) -> list[dict[str, Any]]:
    """Rows of random token ids (the tiny target has no tokenizer of its own), the second half supervised."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = rng.randint(lo, hi)
        ids = [rng.randrange(vocab) for _ in range(length)]
        half = length // 2
        rows.append(
            {
                "id": f"r{seed}-{i}",
                "source": "test",
                "input_ids": ids,
                "loss_mask": [0] * half + [1] * (length - half),
            }
        )
    return rows


def corpus_with_counts(
    store: ArtifactStore, tmp: Path, target: TargetInfo, train: int, held: int, seed: int = 0
) -> StageResult:
    rows = random_rows(target.geometry.vocab_size, train + held, seed)
    splits = {"train": rows[:train]} | ({"eval": rows[train:]} if held else {})
    corpus = write_corpus(store, RUN, splits)
    put_token_counts(store, corpus, rows[:train], target.geometry.vocab_size, tmp)
    return corpus


def put_token_counts(
    store: ArtifactStore, corpus: StageResult, rows: list[dict], vocab_size: int, tmp: Path
) -> None:
    """The corpus's supervised-token counts (what the trainer's draft vocabulary is chosen from), as the
    merge stage writes them, counted over `rows`."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for r in rows:
        ids, mask = torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"], dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    table = tmp / "token_counts.parquet"
    pl.DataFrame({"token_id": list(range(vocab_size)), "count": counts.tolist()}).write_parquet(table)
    store.put_file(f"{corpus.prefix}/token_counts.parquet", table)


def extract_config(tmp: Path, storage: str = "bf16", **kw: Any) -> ExtractConfig:
    return ExtractConfig(
        work_dir=str(tmp / "extract-work"), shard_bytes=1 << 16, batch_tokens=128, storage_dtype=storage, **kw
    )  # type: ignore[arg-type]


def server_config(port: int | None = None, **kw: Any) -> ServerConfig:
    """The reference server on the CPU; the tiny target has no tokenizer (ids only)."""
    return ServerConfig(
        backend="reference",
        device="cpu",
        port=port or free_port(),
        extra_args=["--skip-tokenizer-init"],
        **kw,
    )


def train_config(tmp: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "drafter": {"family": "eagle3", "draft_vocab_size": 64, "ttt_length": 3}, "epochs": 2, "lr": 1e-3, "batch_tokens": 96,
        "max_length": 64, "eval_every": 3, "checkpoint_every": 3, "log_every": 1, "device": "cpu",
        "heldout_samples": 4, "cache_dir": str(tmp / "train-cache"),
    }  # fmt: skip
    return TrainConfig(**(base | kw))


def resume_train_config(tmp: Path) -> TrainConfig:
    """A checkpoint every step, so a kill at any step leaves the step before it to resume from."""
    return train_config(tmp, checkpoint_every=1, eval_every=4, keep_checkpoints=1)


def offline(
    store: ArtifactStore,
    tmp: Path,
    target: TargetInfo,
    corpus: StageResult,
    cfg: TrainConfig,
    ex: ExtractConfig,
) -> StageResult:
    shards = extract(ex, store=store, run_name=RUN, target=target, corpus=corpus, server=server_config())
    return train(cfg, store=store, run_name=RUN, target=target, shards=shards, corpus=corpus)


def online(
    store: ArtifactStore,
    target: TargetInfo,
    corpus: StageResult,
    cfg: TrainConfig,
    ex: ExtractConfig,
    server: ServerConfig | None = None,
    progress: Any = None,
    run_name: str = RUN,
) -> StageResult:
    kw = {"progress": progress} if progress is not None else {}
    return train(
        cfg.model_copy(update={"source": "online"}),
        store=store,
        run_name=run_name,
        target=target,
        shards=None,
        corpus=corpus,
        extract=ex,
        server=server or server_config(),
        **kw,
    )


def drafter_weights(store: ArtifactStore, result: StageResult) -> dict[str, torch.Tensor]:
    local = store.local_path(f"{result.prefix}/drafter/model.safetensors")
    assert local is not None
    return load_file(str(local))


def losses(store: ArtifactStore, result: StageResult) -> list[tuple[int, float]]:
    lines = store.get_bytes(f"{result.prefix}/metrics.jsonl").decode().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["kind"] == "train"]
