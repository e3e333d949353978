"""The train stage on real shards of the embedded default: a small corpus goes through the extract stage
(SmolLM2-135M in the reference server, a real process), the drafter trains on its shards, and the
exported drafter — loaded as the evaluation stage will load it — drafts a chain on the target's own
hidden states."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import torch

from aerie.draft.export import load_drafter
from aerie.draft.model import DraftKVCache
from aerie.extract import work as extract_work
from aerie.extract.config import ExtractConfig
from aerie.serving import ServerConfig
from aerie.store import LocalStore
from aerie.train import work
from aerie.train.config import TrainConfig
from tests.conftest import free_port
from tests.extract_support import corpus_rows, write_corpus
from tests.stage_work import staged

extract = staged("extract", extract_work.run)
train = staged("train", work.run)

pytestmark = pytest.mark.integration  # a reference server process


@pytest.mark.slow
def test_train_on_embedded_default_shards(tmp_path, smollm2):
    torch.set_num_threads(1)
    store = LocalStore(tmp_path / "store")
    rows = corpus_rows(smollm2.load_tokenizer(), 7, seed=5, min_words=20, max_words=40)
    corpus = write_corpus(store, "e2e", {"train": rows[:6], "eval": rows[6:]})
    counts = torch.zeros(smollm2.geometry.vocab_size, dtype=torch.int64)
    for r in rows[:6]:
        ids, mask = torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"], dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=smollm2.geometry.vocab_size)
    table = tmp_path / "token_counts.parquet"
    pl.DataFrame(
        {"token_id": list(range(smollm2.geometry.vocab_size)), "count": counts.tolist()}
    ).write_parquet(table)
    store.put_file(f"{corpus.prefix}/token_counts.parquet", table)

    shards = extract(
        ExtractConfig(work_dir=str(tmp_path / "work"), shard_bytes=1 << 20, batch_tokens=256),
        store=store,
        run_name="e2e",
        target=smollm2,
        corpus=corpus,
        server=ServerConfig(backend="reference", device="cpu", port=free_port()),
    )
    cfg = TrainConfig(
        drafter={"family": "eagle3", "draft_vocab_size": 512, "ttt_length": 3}, epochs=2, lr=1e-3, batch_tokens=256, max_length=256,
        eval_every=2, checkpoint_every=2, device="cpu", cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    result = train(cfg, store=store, run_name="e2e", target=smollm2, shards=shards, corpus=corpus)
    manifest = json.loads(store.get_bytes(f"{result.prefix}/manifest.json"))
    assert manifest["drafter_config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert manifest["drafter_config"]["max_position_embeddings"] == 8192
    assert 0 < manifest["vocab"]["vocab_coverage"] <= 1 and manifest["best"]["accept_length"] >= 1

    # The evaluation stage's path: load the export with the target's embedding, extend on the target's
    # aux hidden states, then chain-draft three tokens through the KV cache.
    drafter = load_drafter(Path(store.root) / result.prefix / "drafter", smollm2, dtype=torch.float32)
    model = smollm2.load_model("cpu")
    ids = torch.tensor(rows[6]["input_ids"])
    with torch.no_grad():
        hs = model(ids[None], output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i][0] for i in smollm2.aux_layers_input], dim=-1)  # [n, 3H]
    n = ids.numel() - 1
    cache = DraftKVCache(drafter.config, "cpu", torch.float32)
    logits, hidden = drafter.step(ids[1:], aux[:n], torch.arange(n), cache)
    drafted = []
    for k in range(3):
        token = drafter.to_target_ids(logits[-1:].argmax(-1))
        drafted.append(int(token))
        logits, hidden = drafter.step(token, hidden[-1:], torch.tensor([n + k]), cache)
    assert cache.length == n + 3 and all(0 <= t < smollm2.geometry.vocab_size for t in drafted)
    assert all(bool(drafter.t2d[t]) for t in drafted)  # drafts come from the draft vocab
