"""The merge stage end to end on a local store: generated and raw inputs, bad rows quarantined with
their reason, duplicates across sources dropped, a disjoint deterministic split whose members do not
move when data is added, masks that decode to the assistant turns, token counts, cache hits, the same
corpus from worker processes, another model's chat template through the whole stage, and a schema
error that names the column and writes nothing."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from aerie.conversation import Conversation, Message
from aerie.corpus import corpus_shards, import_conversations, iter_corpus, work
from aerie.corpus.config import CorpusConfig
from aerie.errors import DataError, SchemaError
from aerie.manifest import load_manifest
from aerie.store import LocalStore, StoreConfig, open_store
from tests.corpus_support import (
    LLAMA_LIKE,
    LLAMA_SPECIAL,
    decoded_runs,
    generated_result,
    msg,
    target_with_template,
)
from tests.stage_work import staged

pytest_plugins = ("tests.s3_support",)

run = staged("merge", work.run)


def _generated_rows(n: int, prefix: str = "g") -> list[dict]:
    return [
        {
            "id": f"{prefix}{i}",
            "source": "gen",
            "messages": [
                msg("user", f"Tell me about topic {prefix}{i}."),
                msg("assistant", f"Topic {prefix}{i} is interesting because of reason {i}."),
                msg("user", "Why?"),
                msg("assistant", f"Because {i * 7} is {'even' if i % 2 == 0 else 'odd'}."),
            ],
            "finish_reasons": ["stop", "stop"],
        }
        for i in range(n)
    ]


BAD_ROWS = [
    {"id": "bad-role", "source": "gen", "messages": [msg("user", "hi"), msg("robot", "beep")]},
    {"id": "bad-order", "source": "gen", "messages": [msg("assistant", "I speak first")]},
    {"id": "empty", "source": "gen", "messages": [msg("user", "hi"), msg("assistant", "   ")]},
    {"id": "no-answer", "source": "gen", "messages": [msg("user", "anyone?")]},
    {
        "id": "cut",
        "source": "gen",
        "messages": [msg("user", "long story please"), msg("assistant", "Once upon a time")],
        "finish_reasons": ["length"],
        "truncated": True,
    },
]


def _raw(n: int) -> list[Conversation]:
    """A raw dataset that already has assistant turns; its first 3 repeat generated conversations."""
    out = []
    for i in range(n):
        if i < 3:
            row = _generated_rows(3)[i]
            messages = tuple(Message(role=m["role"], content=m["content"]) for m in row["messages"])
        else:
            messages = (
                Message(role="user", content=f"raw q{i}"),
                Message(role="assistant", content=f"raw a{i}"),
            )
        out.append(Conversation(id=f"r{i}", source="raw", messages=messages))
    return out


def _expected_answers(row_id: str) -> list[str]:
    """The assistant texts of a conversation, as SmolLM2's template closes them."""
    if row_id.startswith("r") and int(row_id[1:]) >= 3:
        return [f"raw a{row_id[1:]}<|im_end|>\n"]
    i = int(row_id[1:])
    if row_id.startswith("r"):
        row_id = f"g{i}"
    return [
        f"Topic {row_id} is interesting because of reason {i}.<|im_end|>\n",
        f"Because {i * 7} is {'even' if i % 2 == 0 else 'odd'}.<|im_end|>\n",
    ]


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.load_tokenizer()


def test_merge_end_to_end(tmp_path: Path, smollm2, tok):
    store = LocalStore(tmp_path / "store")
    gen = generated_result(store, "run", "gen", _generated_rows(40) + BAD_ROWS)
    raw = import_conversations(_raw(12), store=store, run_name="run", name="raw")
    cfg = CorpusConfig(eval_fraction=0.2, rows_per_shard=10, num_workers=1, max_length=512)
    progress: list[tuple[float, str]] = []
    result = run(
        cfg,
        store=store,
        run_name="run",
        target=smollm2,
        inputs=[gen, raw],
        progress=lambda f, m: progress.append((f, m)),
    )
    manifest = load_manifest(store, result.prefix)
    f = result.figures

    # 57 input rows: 4 malformed, 3 raw duplicates of generated ones; the truncated one is kept.
    assert f["input_rows"] == 57
    assert manifest["dropped"] == {
        "bad_order": 1,
        "bad_role": 1,
        "duplicate": 3,
        "empty_content": 1,
        "no_assistant_turn": 1,
    }
    assert f["records"] == 57 - 7 == f["train_records"] + f["eval_records"]
    quarantine = [
        json.loads(line) for line in store.get_bytes(f"{result.prefix}/quarantine.jsonl").splitlines()
    ]
    assert Counter(q["reason"] for q in quarantine) == Counter(manifest["dropped"])
    assert {q["id"] for q in quarantine if q["reason"] == "duplicate"} == {"r0", "r1", "r2"}
    assert {q["detail"] for q in quarantine if q["id"] == "r0"} == {"same messages as gen/g0"}

    train = list(iter_corpus(store, result, "train"))
    held_out = list(iter_corpus(store, result, "eval"))
    train_ids, eval_ids = [r.id for r in train], [r.id for r in held_out]
    assert not set(train_ids) & set(eval_ids)
    assert len(train_ids) == len(set(train_ids)) == f["train_records"]
    assert 0 < len(eval_ids) < len(train_ids)
    # Shuffled: not in input order.
    assert train_ids != sorted(train_ids, key=lambda s: (s[0], int(s[1:]) if s[1:].isdigit() else 0))

    for row in train + held_out:
        if row.id == "cut":
            assert decoded_runs(tok, row.input_ids, row.loss_mask) == ["Once upon a time"]
        else:
            assert decoded_runs(tok, row.input_ids, row.loss_mask) == _expected_answers(row.id)

    # Token counts = the supervised tokens of the train split, per id; the vocab table has every id.
    counts = pl.read_parquet(store.local_path(f"{result.prefix}/token_counts.parquet"))
    assert counts.schema == pl.Schema({"token_id": pl.Int32, "count": pl.Int64})
    assert counts.height == smollm2.geometry.vocab_size
    supervised = np.concatenate([np.array(r.input_ids)[np.array(r.loss_mask) == 1] for r in train])
    assert np.array_equal(
        counts["count"].to_numpy(), np.bincount(supervised, minlength=smollm2.geometry.vocab_size)
    )

    # Manifest: per-split and per-source totals agree with the shards; hashes and settings recorded.
    shards = manifest["splits"]["train"]["shards"]
    assert [s["key"] for s in shards] == corpus_shards(store, result, "train")
    assert sum(s["rows"] for s in shards) == f["train_records"]
    assert manifest["splits"]["train"]["tokens"] == sum(len(r.input_ids) for r in train)
    assert set(manifest["splits"]["train"]["by_source"]) <= {"gen", "raw"}
    assert manifest["max_length"] == 512 and manifest["seed"] == 0
    assert manifest["chat_template_sha256"] == smollm2.chat_template_sha256
    assert [i["stage"] for i in manifest["inputs"]] == ["generate-gen", "import-raw"]
    assert manifest["figures"]["text"].endswith("tokens") and "records" in manifest["figures"]["text"]
    shard = pl.read_parquet(store.local_path(shards[0]["key"]))
    assert shard.schema == pl.Schema(
        {
            "id": pl.String,
            "source": pl.String,
            "input_ids": pl.List(pl.Int32),
            "loss_mask": pl.List(pl.UInt8),
            "n_tokens": pl.Int32,
            "n_supervised": pl.Int32,
        }
    )
    assert store.get_bytes(f"{result.prefix}/length_hist.png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert progress[-1][0] == 1.0 and all(a[0] <= b[0] for a, b in zip(progress, progress[1:], strict=False))

    again = run(cfg, store=store, run_name="run", target=smollm2, inputs=[gen, raw])
    assert again.cache_hit and again.manifest_sha256 == result.manifest_sha256


@pytest.mark.integration
def test_workers_give_the_same_corpus_and_adding_data_moves_nothing(tmp_path: Path, smollm2):
    store = LocalStore(tmp_path / "store")
    first = generated_result(store, "up", "a", _generated_rows(60))
    cfg = CorpusConfig(eval_fraction=0.25, rows_per_shard=15, num_workers=1, max_length=256, batch_rows=16)
    alone = run(cfg, store=store, run_name="one", target=smollm2, inputs=[first])
    parallel = run(
        cfg.model_copy(update={"num_workers": 2}), store=store, run_name="two", target=smollm2, inputs=[first]
    )
    assert not parallel.cache_hit
    for split in ("train", "eval"):
        assert list(iter_corpus(store, alone, split)) == list(iter_corpus(store, parallel, split))

    more = generated_result(store, "up", "b", _generated_rows(60, prefix="h"))
    grown = run(cfg, store=store, run_name="grown", target=smollm2, inputs=[first, more])
    old_eval = {r.id for r in iter_corpus(store, alone, "eval")}
    new_eval = {r.id for r in iter_corpus(store, grown, "eval")}
    assert {i for i in new_eval if i.startswith("g")} == old_eval
    old_train = [r.id for r in iter_corpus(store, alone, "train")]
    new_train = [r.id for r in iter_corpus(store, grown, "train") if r.id.startswith("g")]
    assert new_train == old_train  # the old conversations keep their relative order

    reseeded = run(
        cfg.model_copy(update={"seed": 1}), store=store, run_name="one", target=smollm2, inputs=[first]
    )
    assert [r.id for r in iter_corpus(store, reseeded, "train")] != old_train


@pytest.mark.integration
def test_another_models_template_through_workers(tmp_path: Path, smollm2):
    llama = target_with_template(smollm2, LLAMA_LIKE, LLAMA_SPECIAL, tmp_path / "llama-like")
    assert llama.chat_template_sha256 != smollm2.chat_template_sha256
    store = LocalStore(tmp_path / "store")
    up = generated_result(store, "run", "gen", _generated_rows(8))
    cfg = CorpusConfig(eval_fraction=0.0, num_workers=2, batch_rows=3)
    result = run(cfg, store=store, run_name="run", target=llama, inputs=[up])
    tok = llama.load_tokenizer()
    rows = list(iter_corpus(store, result, "train"))
    assert len(rows) == 8
    for row in rows:
        answers = [a.replace("<|im_end|>\n", "<|eot_id|>") for a in _expected_answers(row.id)]
        assert decoded_runs(tok, row.input_ids, row.loss_mask) == answers
    manifest = load_manifest(store, result.prefix)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    counts = pl.read_parquet(store.local_path(f"{result.prefix}/token_counts.parquet"))
    # Added tokens sit past the model's vocab_size: the table grows to hold them instead of dropping them.
    assert counts.height > eot and counts["count"][eot] == 16
    assert manifest["splits"]["eval"]["records"] == 0


def test_schema_mismatch_names_the_column_and_writes_nothing(tmp_path: Path, smollm2):
    store = LocalStore(tmp_path / "store")
    good = generated_result(store, "run", "good", _generated_rows(4))
    bad_frame = pl.DataFrame({"id": ["x"], "source": ["bad"], "messages": [["not a struct"]]})
    bad = generated_result(store, "run", "bad", [], frame=bad_frame)
    with pytest.raises(
        SchemaError, match=r"generate-bad/.*conversations\.parquet: column 'messages' is List\(String\)"
    ):
        run(CorpusConfig(num_workers=1), store=store, run_name="run", target=smollm2, inputs=[good, bad])
    assert not [k for k in store.list("run/merge")]
    assert store.exists(f"{bad.prefix}/conversations.parquet")  # the input is untouched


def test_nothing_usable_is_an_error_that_keeps_the_reasons(tmp_path: Path, smollm2):
    store = LocalStore(tmp_path / "store")
    up = generated_result(store, "run", "gen", BAD_ROWS[:4])
    with pytest.raises(DataError, match=r"no usable conversation in 4 input rows .*quarantine\.jsonl"):
        run(CorpusConfig(num_workers=1), store=store, run_name="run", target=smollm2, inputs=[up])
    (quarantine,) = [k for k in store.list("run/merge") if k.endswith("quarantine.jsonl")]
    assert len(store.get_bytes(quarantine).splitlines()) == 4
    assert not [k for k in store.list("run/merge") if k.endswith("manifest.json")]


@pytest.mark.integration
def test_merge_through_s3(s3_config: StoreConfig, smollm2, tok):
    store = open_store(s3_config)  # a real moto server over HTTP: inputs downloaded, outputs uploaded
    up = generated_result(store, "s3run", "gen", _generated_rows(6))
    cfg = CorpusConfig(num_workers=1, eval_fraction=0.0)
    result = run(cfg, store=store, run_name="s3run", target=smollm2, inputs=[up])
    assert result.manifest_uri.startswith("s3://")
    rows = list(iter_corpus(store, result, "train"))
    assert sorted(r.id for r in rows) == sorted(f"g{i}" for i in range(6))
    for row in rows:
        assert decoded_runs(tok, row.input_ids, row.loss_mask) == _expected_answers(row.id)
    assert run(cfg, store=store, run_name="s3run", target=smollm2, inputs=[up]).cache_hit
