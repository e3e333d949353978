"""The corpus stage's parts on the real SmolLM2 tokenizer: template-derived loss masks (SmolLM2's own
template, a Llama-3-style one with an injected system turn and added special tokens, a Qwen3-style
one that rewrites history), truncated turns, both span aligners, conversation checks and schema
errors that name the column."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import polars as pl
import pytest

from aerie.corpus.encoding import BatchEncoder, EncodeOptions
from aerie.corpus.schema import CONVERSATIONS, task_frame
from aerie.corpus.shuffle import Layout
from aerie.corpus.template import ChatRenderer, OffsetsAligner, PrefixAligner, TemplateSpec, make_aligner
from aerie.corpus.validate import Rejected, check_conversation
from aerie.errors import SchemaError
from tests.corpus_support import (
    LLAMA_LIKE,
    LLAMA_SPECIAL,
    THINKING,
    decoded_runs,
    msg,
    task_batch,
    tokenizer_with_template,
)

TWO_TURNS = [
    msg("user", "What is 2+2?"),
    msg("assistant", "4, of course."),
    msg("user", "And 3+3?"),
    msg("assistant", "It is 6.\nSix."),
]


def _encoder(tokenizer, max_length: int = 4096, **options) -> BatchEncoder:
    spec = TemplateSpec.from_tokenizer(tokenizer)
    opts = {"truncated_policy": "keep", "history_mismatch": "split", **options}
    return BatchEncoder(spec, EncodeOptions(max_length=max_length, layout=Layout(0, 0.0, (1, 0)), **opts))


def _rows(result) -> list[dict]:
    return result.frame.sort("src", "sub").to_dicts()


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.load_tokenizer()


def test_smollm2_masks_are_exactly_the_assistant_turns(tok):
    with_system = [msg("system", "Be brief."), *TWO_TURNS]
    result = _encoder(tok)(task_batch([TWO_TURNS, with_system]))
    assert result.quarantine == []
    rows = _rows(result)
    for row, messages in zip(rows, [TWO_TURNS, with_system], strict=True):
        # Exactly what the template renders for the model to produce: the answer, <|im_end|> and the
        # newline the template puts after it; nothing of the (injected or given) system or user turns.
        assert decoded_runs(tok, row["input_ids"], row["loss_mask"]) == [
            "4, of course.<|im_end|>\n",
            "It is 6.\nSix.<|im_end|>\n",
        ]
        # The sequence is the target's own apply_chat_template tokenization, token for token.
        assert (
            row["input_ids"]
            == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        )
        assert row["n_tokens"] == len(row["input_ids"])
        assert row["n_supervised"] == sum(row["loss_mask"])
    injected = tok.decode(rows[0]["input_ids"][:20])
    assert injected.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_a_llama3_style_template_with_injected_system_and_added_tokens(tok):
    llama = tokenizer_with_template(tok, LLAMA_LIKE, LLAMA_SPECIAL)
    result = _encoder(llama)(task_batch([TWO_TURNS]))
    (row,) = _rows(result)
    assert decoded_runs(llama, row["input_ids"], row["loss_mask"]) == [
        "4, of course.<|eot_id|>",
        "It is 6.\nSix.<|eot_id|>",
    ]
    assert (
        row["input_ids"] == llama.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=True)["input_ids"]
    )
    eot = llama.convert_tokens_to_ids("<|eot_id|>")
    assert eot >= 49152  # an added special token, past the model's vocab
    assert row["input_ids"].count(eot) == 5  # injected system + 4 turns; 2 of them supervised
    assert sum(1 for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if t == eot and m) == 2
    assert "Cutting Knowledge Date" in llama.decode(row["input_ids"])


def test_history_rewritten_by_the_template_gets_its_own_sample(tok):
    thinking = tokenizer_with_template(tok, THINKING)
    conversation = [
        msg("user", "Q1"),
        msg("assistant", "A1", reasoning="R1 step"),
        msg("user", "Q2"),
        msg("assistant", "A2", reasoning="R2 step"),
        msg("user", "Q3"),
        msg("assistant", "A3", reasoning="R3 step"),
    ]
    result = _encoder(thinking)(task_batch([conversation], id=["t"]))
    whole, first, second = _rows(result)
    assert (whole["id"], first["id"], second["id"]) == ("t", "t#m1", "t#m3")
    # As the server saw turn 3: earlier turns in history form (no reasoning), turn 3 with its reasoning.
    assert decoded_runs(thinking, whole["input_ids"], whole["loss_mask"]) == [
        "<think>\nR3 step\n</think>\n\nA3<|im_end|>\n"
    ]
    assert "R1 step" not in thinking.decode(whole["input_ids"])
    # Turns 1 and 2 as they were generated: each its own sample, its reasoning supervised.
    for row, n in ((first, 1), (second, 2)):
        assert decoded_runs(thinking, row["input_ids"], row["loss_mask"]) == [
            f"<think>\nR{n} step\n</think>\n\nA{n}<|im_end|>\n"
        ]
    assert result.counts["history_rewritten_turns"] == 2

    masked = _encoder(thinking, history_mismatch="mask")(task_batch([conversation], id=["t"]))
    (only,) = _rows(masked)
    assert decoded_runs(thinking, only["input_ids"], only["loss_mask"]) == [
        "<think>\nR3 step\n</think>\n\nA3<|im_end|>\n"
    ]
    assert masked.counts["history_rewritten_turns"] == 2


def test_reasoning_the_template_cannot_render_is_counted(tok):
    result = _encoder(tok)(
        task_batch([[msg("user", "Q"), msg("assistant", "A", reasoning="hidden thoughts")]])
    )
    (row,) = _rows(result)
    assert decoded_runs(tok, row["input_ids"], row["loss_mask"]) == ["A<|im_end|>\n"]
    assert result.counts["reasoning_not_rendered"] == 1


def test_a_template_that_refuses_a_conversation_quarantines_it(tok):
    # Gemma-style: the template itself raises on a system turn.
    strict = tokenizer_with_template(
        tok,
        "{%- if messages[0].role == 'system' -%}{{ raise_exception('System role not supported') }}{%- endif -%}"
        + tok.chat_template,
    )
    result = _encoder(strict)(
        task_batch([[msg("system", "sys"), *TWO_TURNS], TWO_TURNS], id=["sys", "plain"])
    )
    assert [r["id"] for r in _rows(result)] == ["plain"]
    (entry,) = result.quarantine
    assert (entry["id"], entry["reason"]) == ("sys", "template_error")
    assert "System role not supported" in entry["detail"]


def test_truncated_turn_supervises_no_end_of_turn(tok):
    cut = [msg("user", "Write a long story."), msg("assistant", "Once upon a time there was")]
    batch = task_batch(
        [cut, TWO_TURNS], truncated=[True, True], finish_reasons=[["length"], ["length", "stop"]]
    )
    result = _encoder(tok)(batch)
    first, second = _rows(result)
    # Cut at max_tokens: the model never produced <|im_end|>, so neither is it in the sample nor supervised.
    assert decoded_runs(tok, first["input_ids"], first["loss_mask"]) == ["Once upon a time there was"]
    assert tok.decode(first["input_ids"]).endswith("there was")
    # A cut earlier turn stays in the history as rendered, but only its text is supervised.
    assert decoded_runs(tok, second["input_ids"], second["loss_mask"]) == [
        "4, of course.",
        "It is 6.\nSix.<|im_end|>\n",
    ]
    assert result.counts["truncated_turns"] == 2

    dropped = _encoder(tok, truncated_policy="drop")(batch)
    assert dropped.frame.is_empty()
    assert [q["reason"] for q in dropped.quarantine] == ["truncated", "truncated"]


def test_max_length_truncates_and_drops_samples_left_without_supervision(tok):
    long_prompt = [msg("user", "word " * 400), msg("assistant", "short answer")]
    result = _encoder(tok, max_length=64)(task_batch([TWO_TURNS, long_prompt], id=["ok", "long"]))
    (row,) = _rows(result)
    assert row["id"] == "ok"
    assert result.quarantine == [
        {
            "id": "long",
            "source": "test",
            "reason": "no_supervised_tokens",
            "detail": "no assistant token within max_length=64",
        }
    ]
    assert result.counts["dropped.no_supervised_tokens"] == 1


def test_prefix_aligner_agrees_with_offsets_including_a_boundary_merge(tok, smollm2):
    spec = TemplateSpec.from_tokenizer(tok)
    renderer = ChatRenderer(spec)
    conversations = [
        TWO_TURNS,
        # Leading spaces: SmolLM2's pre-tokenizer merges "\n " across the prompt/answer boundary.
        [
            msg("user", "Indent this"),
            msg("assistant", "    indented\n  code"),
            msg("user", "ok"),
            msg("assistant", " x"),
        ],
    ]
    samples = [s for c in conversations for s in renderer.samples(c, frozenset(), "split")[0]]
    fast = OffsetsAligner(spec.backend).encode(samples)
    # The path a tokenizer without offsets takes: loaded from the target, token-level prefix differences.
    slow_aligner = make_aligner(dataclasses.replace(spec, backend=None, target=smollm2))
    assert isinstance(slow_aligner, PrefixAligner)
    slow = slow_aligner.encode(samples)
    for a, b in zip(fast, slow, strict=True):
        assert a.ids.tolist() == b.ids.tolist()
        assert a.mask.tolist() == b.mask.tolist()
        assert a.straddled == b.straddled
    assert [e.straddled for e in fast] == [0, 1]  # " x" after "\n" does not merge; "    indented" does
    # The straddling token is supervised: no answer character is left out.
    ids, mask = fast[1].ids, fast[1].mask
    assert "    indented\n  code<|im_end|>\n" in tok.decode(ids[mask == 1].tolist())


@pytest.mark.parametrize(
    ("messages", "code"),
    [
        ([], "no_messages"),
        ([msg("user", "hi"), msg("bot", "hello")], "bad_role"),
        ([msg("user", "hi"), msg("user", "again"), msg("assistant", "yes")], "bad_order"),
        ([msg("assistant", "I start")], "bad_order"),
        ([msg("user", "hi"), msg("system", "late system"), msg("assistant", "x")], "bad_order"),
        ([msg("user", "   "), msg("assistant", "x")], "empty_content"),
        ([msg("user", "hi"), msg("assistant", "")], "empty_content"),
        ([msg("system", "sys"), msg("user", "only a question")], "no_assistant_turn"),
    ],
)
def test_conversation_checks_name_the_reason(messages, code):
    with pytest.raises(Rejected) as err:
        check_conversation(messages, truncated=False, finish_reasons=[], truncated_policy="keep")
    assert err.value.code == code


def test_trailing_user_turns_are_trimmed():
    checked = check_conversation(
        [msg("user", "q"), msg("assistant", "a", reasoning="thinking"), msg("user", "more?")],
        truncated=True,
        finish_reasons=["length"],
        truncated_policy="keep",
    )
    assert [m["role"] for m in checked.messages] == ["user", "assistant"]
    assert checked.messages[1] == {"role": "assistant", "content": "a", "reasoning": "thinking"}
    assert checked.trimmed == 1
    assert checked.truncated_turns == frozenset({1})


def test_a_reasoning_only_answer_is_a_truncated_turn_never_a_complete_one():
    conversation = [
        msg("user", "q"),
        msg("assistant", "", reasoning="thinking cut off"),
        msg("user", "more?"),
    ]
    # Even when the endpoint said it stopped: reasoning without an answer is not a finished turn.
    checked = check_conversation(
        conversation, truncated=False, finish_reasons=["stop"], truncated_policy="keep"
    )
    assert checked.truncated_turns == frozenset({1})
    assert checked.messages[1] == {"role": "assistant", "content": "", "reasoning": "thinking cut off"}
    with pytest.raises(Rejected) as err:
        check_conversation(conversation, truncated=False, finish_reasons=["stop"], truncated_policy="drop")
    assert err.value.code == "truncated"
    with pytest.raises(Rejected) as err:
        check_conversation(
            conversation, truncated=False, finish_reasons=[], truncated_policy="keep", reasoning_policy="drop"
        )
    assert err.value.code == "reasoning_only_answer"
    assert (
        err.value.detail
        == "message 1 (assistant) has only reasoning and no final answer (corpus.reasoning=drop)"
    )


@pytest.mark.parametrize(
    ("frame", "column"),
    [
        (
            pl.DataFrame({"id": ["a"], "messages": [[{"role": "user", "content": "x"}]]}),
            "'source' is missing",
        ),
        (
            pl.DataFrame({"id": ["a"], "source": ["s"], "messages": [["just text"]]}),
            "column 'messages' is List(String)",
        ),
        (
            pl.DataFrame({"id": ["a"], "source": ["s"], "messages": [[{"role": 1, "content": "x"}]]}),
            "field 'messages.role' is Int64",
        ),
        (
            pl.DataFrame({"id": [1], "source": ["s"], "messages": [[{"role": "u", "content": "x"}]]}),
            "column 'id' is Int64",
        ),
        (
            pl.DataFrame({"id": ["a"], "source": ["s"], "messages": [[{"role": "u", "text": "x"}]]}),
            "has no field 'content'",
        ),
        (
            pl.DataFrame(
                {
                    "id": ["a"],
                    "source": ["s"],
                    "messages": [[{"role": "u", "content": "x"}]],
                    "truncated": ["no"],
                }
            ),
            "column 'truncated' is String",
        ),
    ],
)
def test_schema_errors_name_the_column(tmp_path: Path, frame: pl.DataFrame, column: str):
    path = tmp_path / "conversations.parquet"
    frame.write_parquet(path)
    with pytest.raises(SchemaError, match=f"in.parquet: .*{re.escape(column)}"):
        task_frame(path, 0, "in.parquet")


def test_raw_rows_without_optional_columns_are_read(tmp_path: Path):
    path = tmp_path / "raw.parquet"
    pl.DataFrame(
        {"id": ["a"], "source": ["raw"], "messages": [[{"role": "user", "content": "x"}]]}
    ).write_parquet(path)
    frame = task_frame(path, 3, "raw").collect()
    assert frame.row(0, named=True) == {
        "src": 3 << 40,
        "id": "a",
        "source": "raw",
        "messages": [{"role": "user", "content": "x", "reasoning": None}],
        "truncated": False,
        "finish_reasons": [],
    }


def test_input_contract_is_the_generation_stage_schema():
    from aerie.generate.output import SCHEMA

    assert dict(SCHEMA) == CONVERSATIONS


def test_a_flipped_byte_in_a_stored_shard_is_refused_naming_it(tmp_path):
    from aerie.corpus.reader import iter_corpus
    from aerie.errors import IntegrityError
    from aerie.store import LocalStore
    from tests.extract_support import write_corpus

    store = LocalStore(tmp_path / "store")
    rows = [
        {"id": f"c{i}", "source": "t", "input_ids": list(range(i, i + 20)), "loss_mask": [0] * 10 + [1] * 10}
        for i in range(20)
    ]
    result = write_corpus(store, "r", {"train": rows}, rows_per_shard=10)
    assert len(list(iter_corpus(store, result, "train"))) == 20
    shard = store.local_path(f"{result.prefix}/train-00001.parquet")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="train-00001.parquet"):
        list(iter_corpus(store, result, "train"))
