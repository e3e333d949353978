"""Online training (`train.source: online`) against real reference servers on the CPU: the drafter and
every step's loss are the offline run's, bit for bit; nothing is written but checkpoints and the drafter."""

from __future__ import annotations

import json

import pytest
import torch

from aerie.store import LocalStore
from tests.online_support import (
    corpus_with_counts,
    drafter_weights,
    extract_config,
    losses,
    offline,
    online,
    train_config,
)
from tests.train_support import tiny_target

pytestmark = pytest.mark.integration  # reference server processes


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_online_training_is_the_offline_training_bit_for_bit(tmp_path, storage):
    torch.set_num_threads(1)
    target, _ = tiny_target(tmp_path)
    store = LocalStore(tmp_path / "store")
    corpus = corpus_with_counts(store, tmp_path, target, train=14, held=4)
    cfg = train_config(tmp_path)
    ex = extract_config(tmp_path, storage)
    shards_run = offline(store, tmp_path, target, corpus, cfg, ex)
    # A look-ahead smaller than a request, and a cache that holds part of the corpus: neither changes a value.
    small = cfg.online.model_copy(update={"buffer_tokens": 100, "cache_bytes": 200_000})
    online_cfg = cfg.model_copy(update={"online": small})
    before = {p for p in (tmp_path / "store").rglob("*") if p.is_file()}
    online_run = online(store, target, corpus, online_cfg, ex)

    assert losses(store, online_run) == losses(store, shards_run) and len(losses(store, shards_run)) > 3
    offline_w, online_w = drafter_weights(store, shards_run), drafter_weights(store, online_run)
    assert offline_w.keys() == online_w.keys()
    for name, w in offline_w.items():
        assert torch.equal(w, online_w[name]), name
    written = {p for p in (tmp_path / "store").rglob("*") if p.is_file()} - before
    assert written and not any("shard" in p.name or p.suffix == ".parquet" for p in written)
    assert all(f"/train/{online_run.prefix.split('/')[-1]}/" in str(p) for p in written)
    manifest = json.loads(store.get_bytes(f"{online_run.prefix}/manifest.json"))
    (rank,) = manifest["online"]["ranks"]
    assert manifest["online"]["shard_bytes_written"] == 0
    # The budget, plus the samples of the one row that crossed it (a row holds at most batch_tokens of
    # pieces, and its first and last samples may be longer than their pieces).
    assert 0 < rank["peak_buffered_tokens"] <= 100 + 96 + 2 * 48
    assert rank["cache_hits"] > 0 and 0 < rank["cache_bytes"] <= 200_000
    assert manifest["figures"]["source"] == "online" and manifest["figures"]["server_restarts"] == 0
