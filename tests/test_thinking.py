"""Thinking models in the corpus: what is supervised, read back as text, for a Qwen3-style template (it
drops old reasoning from history) and a Kimi-K2.5-style one (it blanks the reasoning of every finished
turn, the last one included), with the reasoning in its field, inline in the content, cut off inside
`<think>` and absent; the reasoning policies; the reasoning parsers; and the merge stage on a tiny
thinking target, whose run summary states the reasoning share.

The tokenizer is the embedded SmolLM2 one with the templates' turn markers and think tags added as
special tokens, as a real thinking model's tokenizer has them."""

from __future__ import annotations

from pathlib import Path

import pytest

from aerie.config import PipelineConfig
from aerie.corpus import iter_corpus, work
from aerie.corpus.config import CorpusConfig
from aerie.corpus.encoding import BatchEncoder, EncodeOptions
from aerie.corpus.shuffle import Layout
from aerie.corpus.template import TemplateSpec
from aerie.manifest import load_manifest
from aerie.pipeline import PipelineReport
from aerie.reasoning import PARSERS, parser_for, reasoning_line
from aerie.store import LocalStore
from tests.corpus_support import (
    decoded_runs,
    generated_result,
    msg,
    target_with_template,
    task_batch,
    tokenizer_with_template,
)
from tests.stage_work import staged

run = staged("merge", work.run)

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
KIMI = (TEMPLATES / "kimi_k25.jinja").read_text()
THINK_TAGS = ["<think>", "</think>"]
KIMI_SPECIAL = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", *THINK_TAGS]
QWEN = PARSERS["qwen3"]
KIMI_PARSER = PARSERS["kimi_k2"]

TWO_TURNS = [
    msg("user", "Q1"),
    msg("assistant", "A1", reasoning="R1 first thoughts"),
    msg("user", "Q2"),
    msg("assistant", "A2", reasoning="R2 second thoughts"),
]


@pytest.fixture(scope="module")
def qwen3(smollm2):
    return tokenizer_with_template(smollm2.load_tokenizer(), QWEN3, THINK_TAGS)


@pytest.fixture(scope="module")
def kimi(smollm2):
    return tokenizer_with_template(smollm2.load_tokenizer(), KIMI, KIMI_SPECIAL)


def _encode(tokenizer, conversations, parser, reasoning="train", history_mismatch="split", **columns):
    spec = TemplateSpec.from_tokenizer(tokenizer, parser=parser)
    options = EncodeOptions(
        max_length=4096,
        truncated_policy="keep",
        history_mismatch=history_mismatch,
        layout=Layout(0, 0.0, (1, 0)),
        reasoning=reasoning,
    )
    return BatchEncoder(spec, options)(task_batch(conversations, **columns))


def _supervised(tokenizer, result) -> dict[str, list[str]]:
    """Sample id -> its supervised runs, as text."""
    rows = result.frame.sort("src", "sub").to_dicts()
    return {r["id"]: decoded_runs(tokenizer, r["input_ids"], r["loss_mask"]) for r in rows}


def _reasoning_counts(result) -> tuple[int, int]:
    return int(result.frame["n_reasoning_supervised"].sum()), int(result.frame["n_reasoning"].sum())


# -- Qwen3-style: history loses its reasoning, the last turn keeps it --------------------------------


def test_qwen3_every_turns_reasoning_is_supervised_once(qwen3):
    result = _encode(qwen3, [TWO_TURNS], QWEN, id=["t"])
    assert result.quarantine == []
    assert _supervised(qwen3, result) == {
        # As the server saw turn 2: turn 1 in history form (no reasoning), turn 2 with its reasoning.
        "t": ["<think>\nR2 second thoughts\n</think>\n\nA2<|im_end|>\n"],
        # Turn 1 as it was generated, its own sample.
        "t#m1": ["<think>\nR1 first thoughts\n</think>\n\nA1<|im_end|>\n"],
    }
    supervised, total = _reasoning_counts(result)
    assert supervised == total > 0


def test_qwen3_inline_reasoning_is_parsed_like_the_field(qwen3):
    inline = [
        msg("user", "Q1"),
        msg("assistant", "<think>\nR1 first thoughts\n</think>\n\nA1"),
        msg("user", "Q2"),
        msg("assistant", "<think>\nR2 second thoughts\n</think>\n\nA2"),
    ]
    result = _encode(qwen3, [inline], QWEN, id=["t"])
    assert _supervised(qwen3, result) == _supervised(qwen3, _encode(qwen3, [TWO_TURNS], QWEN, id=["t"]))
    assert result.counts["reasoning_inline_parsed"] == 2
    # Without a parser (reasoning_parser=none) a content that opens with <think> is still split by that
    # convention: the same reasoning, where this template renders it.
    raw = _supervised(qwen3, _encode(qwen3, [inline], None, id=["t"]))
    assert raw["t"] == ["<think>\nR2 second thoughts\n</think>\n\nA2<|im_end|>\n"]


def test_qwen3_cut_off_inside_think_is_truncated_without_the_end_tag(qwen3):
    cut_inline = [msg("user", "Q"), msg("assistant", "<think>\nStep one, then step")]
    cut_field = [msg("user", "Q"), msg("assistant", "", reasoning="Step one, then step")]
    only_reasoning = [msg("user", "Q"), msg("assistant", "<think>\nStep one, then step\n</think>\n\n")]
    result = _encode(
        qwen3,
        [cut_inline, cut_field, only_reasoning],
        QWEN,
        id=["inline", "field", "only"],
        finish_reasons=[["length"], ["length"], ["stop"]],
    )
    assert result.quarantine == []
    # What the model wrote, and nothing it did not: no </think>, no answer, no end of turn.
    for runs in _supervised(qwen3, result).values():
        assert runs == ["<think>\nStep one, then step"]
    assert result.counts["truncated_turns"] == 3
    assert result.counts["reasoning_without_answer"] == 3
    # The same rule as a cut-off answer: truncated_policy=drop quarantines all three.
    spec = TemplateSpec.from_tokenizer(qwen3, parser=QWEN)
    options = EncodeOptions(4096, "drop", "split", Layout(0, 0.0, (1, 0)))
    dropped = BatchEncoder(spec, options)(task_batch([cut_inline, cut_field, only_reasoning]))
    assert [q["reason"] for q in dropped.quarantine] == ["truncated"] * 3
    assert "reasoning and no answer" in dropped.quarantine[0]["detail"]


def test_qwen3_without_reasoning_supervises_what_the_template_renders(qwen3):
    result = _encode(qwen3, [[msg("user", "Q"), msg("assistant", "A")]], QWEN, id=["t"])
    # Qwen3's template gives the last turn an empty think block; the generation prompt has none.
    assert _supervised(qwen3, result) == {"t": ["<think>\n\n</think>\n\nA<|im_end|>\n"]}
    assert _reasoning_counts(result) == (0, 0)


# -- Kimi-K2.5-style: every finished turn blanked, the generation prompt opens <think> ----------------


def test_kimi_every_turns_reasoning_is_put_back_and_supervised_once(kimi):
    result = _encode(kimi, [TWO_TURNS], KIMI_PARSER, id=["t"])
    assert result.quarantine == []
    assert _supervised(kimi, result) == {
        "t": ["R2 second thoughts</think>A2<|im_end|>"],
        "t#m1": ["R1 first thoughts</think>A1<|im_end|>"],
    }
    rows = {r["id"]: r for r in result.frame.to_dicts()}
    whole = kimi.decode(rows["t"]["input_ids"])
    # The context is what the server sent: history blanked, the generation prompt opening <think>.
    assert "<think></think>A1<|im_end|>" in whole
    assert whole.endswith(
        "<|im_assistant|>assistant<|im_middle|><think>R2 second thoughts</think>A2<|im_end|>"
    )
    assert result.counts["reasoning_put_back"] == 2
    assert result.counts["reasoning_not_rendered"] == 0
    supervised, total = _reasoning_counts(result)
    assert supervised == total > 0


def test_kimi_inline_reasoning_with_or_without_the_opening_tag(kimi):
    # An endpoint without a reasoning parser returns what followed the prompt's <think>: no opening tag.
    opened = [msg("user", "Q"), msg("assistant", "R thoughts</think>A")]
    tagged = [msg("user", "Q"), msg("assistant", "<think>R thoughts</think>A")]
    result = _encode(kimi, [opened, tagged], KIMI_PARSER, id=["opened", "tagged"])
    assert _supervised(kimi, result) == {
        "opened": ["R thoughts</think>A<|im_end|>"],
        "tagged": ["R thoughts</think>A<|im_end|>"],
    }


def test_kimi_cut_off_and_absent_reasoning(kimi):
    cut = [msg("user", "Q"), msg("assistant", "", reasoning="Step one, then")]
    absent = [msg("user", "Q"), msg("assistant", "A")]
    result = _encode(
        kimi, [cut, absent], KIMI_PARSER, id=["cut", "absent"], finish_reasons=[["length"], ["stop"]]
    )
    assert _supervised(kimi, result) == {
        "cut": ["Step one, then"],  # after the prompt's <think>; no </think>, no end of turn
        "absent": ["</think>A<|im_end|>"],  # it closed its think block at once
    }


def test_kimi_history_mask_supervises_only_the_last_turns_reasoning(kimi):
    result = _encode(kimi, [TWO_TURNS], KIMI_PARSER, history_mismatch="mask", id=["t"])
    assert _supervised(kimi, result) == {"t": ["R2 second thoughts</think>A2<|im_end|>"]}
    supervised, total = _reasoning_counts(result)
    assert 0 < supervised < total  # turn 1's reasoning is in the data, counted, not supervised


def test_a_template_without_reasoning_supervises_none_of_it(smollm2):
    tok = smollm2.load_tokenizer()
    result = _encode(tok, [TWO_TURNS], None, id=["t"])
    assert _supervised(tok, result)["t"] == ["A1<|im_end|>\n", "A2<|im_end|>\n"]
    supervised, total = _reasoning_counts(result)
    assert supervised == 0 and total > 0
    line = reasoning_line({"reasoning_tokens": total, "reasoning_tokens_supervised": supervised})
    assert line is not None and line.startswith(f"reasoning tokens supervised: 0 of {total}")
    assert "WARNING" in line and "none is supervised" in line


# -- reasoning-only answers: one rule wherever they arrive ------------------------------------------


@pytest.mark.parametrize("parser", [None, QWEN], ids=["no-parser", "qwen3-forced"])
def test_a_reasoning_only_answer_the_template_cannot_render_is_quarantined(smollm2, parser):
    # SmolLM2's template renders no reasoning: a turn that only reasoned would supervise one end of turn.
    tok = smollm2.load_tokenizer()
    shapes = {
        "field": [msg("user", "Q"), msg("assistant", "", reasoning="R only")],
        "inline": [msg("user", "Q"), msg("assistant", "<think>R only</think>\n\n")],
        "cut": [msg("user", "Q"), msg("assistant", "<think>R cut off")],
        "answered": [msg("user", "Q"), msg("assistant", "<think>R</think>\n\nA")],
        "plain": [msg("user", "Q"), msg("assistant", "an answer about </think> tags")],
    }
    result = _encode(tok, list(shapes.values()), parser, id=list(shapes), finish_reasons=[["stop"]] * 5)
    assert [(q["id"], q["reason"]) for q in result.quarantine] == [
        ("field", "reasoning_only_answer"),
        ("inline", "reasoning_only_answer"),
        ("cut", "reasoning_only_answer"),
    ]
    assert "does not render" in result.quarantine[0]["detail"]
    supervised = _supervised(tok, result)
    # The answer, never the think block (the leading newlines are the template's and the answer's).
    assert [run.lstrip("\n") for run in supervised["answered"]] == ["A<|im_end|>\n"]
    if parser is None:  # without a parser only a content that opens with the tag holds reasoning
        assert [run.lstrip("\n") for run in supervised["plain"]] == [
            "an answer about </think> tags<|im_end|>\n"
        ]


# -- policies ---------------------------------------------------------------------------------------


def test_policy_drop_trains_answers_only(kimi):
    only_reasoning = [msg("user", "Q"), msg("assistant", "", reasoning="thinking")]
    result = _encode(kimi, [TWO_TURNS, only_reasoning], KIMI_PARSER, reasoning="drop", id=["t", "only"])
    assert _supervised(kimi, result) == {"t": ["</think>A1<|im_end|>", "</think>A2<|im_end|>"]}
    assert "thoughts" not in kimi.decode(result.frame["input_ids"][0])
    (entry,) = result.quarantine
    assert (entry["id"], entry["reason"]) == ("only", "reasoning_only_answer")
    assert "corpus.reasoning=drop" in entry["detail"]
    assert _reasoning_counts(result) == (0, 0)


def test_policy_refuse_quarantines_conversations_with_reasoning(kimi):
    plain = [msg("user", "Q"), msg("assistant", "A")]
    inline = [msg("user", "Q"), msg("assistant", "<think>hm</think>A")]
    result = _encode(
        kimi, [TWO_TURNS, plain, inline], KIMI_PARSER, reasoning="refuse", id=["t", "plain", "inline"]
    )
    assert [(q["id"], q["reason"]) for q in result.quarantine] == [
        ("t", "reasoning_refused"),
        ("inline", "reasoning_refused"),
    ]
    assert _supervised(kimi, result) == {"plain": ["</think>A<|im_end|>"]}


# -- parsers ----------------------------------------------------------------------------------------


def test_parsers_split_by_sglangs_names():
    assert QWEN.split("<think>\nR\n</think>\n\nA").reasoning == "\nR\n"
    assert QWEN.split("plain answer").reasoning is None
    assert QWEN.split("<think>cut").cut
    assert QWEN.split("R</think>A", opened=True).answer == "A"
    r1 = PARSERS["deepseek-r1"].split("all reasoning, cut")  # R1 starts inside its reasoning
    assert (r1.reasoning, r1.answer, r1.cut) == ("all reasoning, cut", "", True)
    kimi_vl = PARSERS["kimi"].split("◁think▷R◁/think▷A")
    assert (kimi_vl.reasoning, kimi_vl.answer) == ("R", "A")
    assert KIMI_PARSER.opened_by("<|im_middle|><think>") and not KIMI_PARSER.opened_by("<think></think>")


def test_the_parser_follows_the_family_and_the_template():
    assert parser_for("Qwen3ForCausalLM", QWEN3).name == "qwen3"
    assert parser_for("KimiK25ForConditionalGeneration", KIMI).name == "kimi_k2"
    assert parser_for("DeepseekV3ForCausalLM", KIMI).name == "kimi_k2"  # Kimi-K2-Thinking's architecture
    assert parser_for("LlamaForCausalLM", QWEN3).name == "qwen3"  # any template that writes </think>
    assert parser_for("Qwen3ForCausalLM", "{{ messages[0].content }}") is None  # no think tag: not thinking
    assert parser_for("Qwen3ForCausalLM", QWEN3, "none") is None
    assert parser_for("LlamaForCausalLM", "", "deepseek-r1").name == "deepseek-r1"
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        CorpusConfig(reasoning_parser="nope")


# -- the merge stage on a tiny thinking target ------------------------------------------------------


def test_a_kimi_style_target_supervises_every_turns_reasoning_and_the_summary_says_so(tmp_path, smollm2):
    target = target_with_template(smollm2, KIMI, KIMI_SPECIAL, tmp_path / "kimi-like")
    store = LocalStore(tmp_path / "store")
    rows = [
        {
            "id": f"c{i}",
            "source": "gen",
            "messages": [
                msg("user", f"Q{i}a"),
                msg("assistant", f"A{i}a", reasoning=f"thinking about a{i}"),
                msg("user", f"Q{i}b"),
                msg("assistant", f"A{i}b", reasoning=f"thinking about b{i}"),
            ],
            "finish_reasons": ["stop", "stop"],
        }
        for i in range(4)
    ]
    up = generated_result(store, "run", "gen", rows)
    cfg = CorpusConfig(eval_fraction=0.0, num_workers=1)
    result = run(cfg, store=store, run_name="run", target=target, inputs=[up])
    tok = target.load_tokenizer()
    supervised = sorted(
        text
        for row in iter_corpus(store, result, "train")
        for text in decoded_runs(tok, row.input_ids, row.loss_mask)
    )
    expected = sorted(f"thinking about {t}{i}</think>A{i}{t}<|im_end|>" for i in range(4) for t in "ab")
    assert supervised == expected
    manifest = load_manifest(store, result.prefix)
    reasoning = manifest["reasoning"]
    assert (reasoning["policy"], reasoning["parser"], reasoning["warning"]) == ("train", "qwen3", None)
    assert reasoning["reasoning_tokens"] == reasoning["reasoning_tokens_supervised"] > 0
    assert manifest["notes"]["reasoning_put_back"] == 8
    n = reasoning["reasoning_tokens"]
    table = PipelineReport(PipelineConfig(), results=[result]).table()
    assert f"reasoning tokens supervised: {n} of {n} (100.0%)" in table

    # The corrected template as an override: its hash is in the key, so the corpus is rebuilt.
    plain = tmp_path / "plain.jinja"
    plain.write_text(smollm2.load_tokenizer().get_chat_template())
    overridden = run(
        cfg.model_copy(update={"chat_template": str(plain)}),
        store=store,
        run_name="run",
        target=target,
        inputs=[up],
    )
    assert overridden.prefix != result.prefix
    again = load_manifest(store, overridden.prefix)
    assert again["reasoning"]["reasoning_tokens_supervised"] == 0
    assert "none is supervised" in again["reasoning"]["warning"]
    assert "WARNING" in PipelineReport(PipelineConfig(), results=[overridden]).table()


def test_every_reasoning_shape_an_endpoint_returns_is_read():
    from aerie.generate.client import message_reasoning

    assert message_reasoning({"content": "A", "reasoning_content": "R"}) == "R"
    assert message_reasoning({"content": "A", "reasoning": "R"}) == "R"
    details = [{"type": "reasoning.text", "text": "R1 "}, {"type": "reasoning.summary", "summary": "R2"}]
    assert message_reasoning({"content": "A", "reasoning_details": details}) == "R1 R2"
    assert message_reasoning({"content": "A", "reasoning_details": [{"type": "reasoning.encrypted"}]}) is None
    assert message_reasoning({"content": "A"}) is None


def test_generation_is_launched_with_the_targets_reasoning_parser(tmp_path, smollm2):
    from aerie.generate.server import reasoning_args

    thinking = target_with_template(smollm2, QWEN3, THINK_TAGS, tmp_path / "qwen3-like")
    sglang = PipelineConfig().model_copy(
        update={"server": PipelineConfig().server.model_copy(update={"backend": "sglang"})}
    )
    assert reasoning_args(sglang, thinking) == ["--reasoning-parser", "qwen3"]
    assert reasoning_args(sglang, smollm2) == []  # its template writes no think block
    # The reference server takes the same flag; a launch that names one keeps its own.
    assert reasoning_args(PipelineConfig(), thinking) == ["--reasoning-parser", "qwen3"]
    named = PipelineConfig().model_copy(
        update={
            "server": PipelineConfig().server.model_copy(update={"extra_args": ["--reasoning-parser=none"]})
        }
    )
    assert reasoning_args(named, thinking) == []


def test_a_chat_template_override_reaches_the_generation_server(tmp_path, smollm2):
    from aerie.errors import ConfigError
    from aerie.generate.server import reasoning_args

    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3)
    cfg = PipelineConfig().model_copy(update={"corpus": CorpusConfig(chat_template=str(template))})
    # The override is what the parser is read from: SmolLM2's own template writes no think block.
    assert reasoning_args(cfg, smollm2) == ["--chat-template", str(template), "--reasoning-parser", "qwen3"]
    docker = cfg.model_copy(update={"server": cfg.server.model_copy(update={"launcher": "docker"})})
    with pytest.raises(ConfigError, match="cannot read the file"):
        reasoning_args(docker, smollm2)


# -- the reference server's chat format (the server process itself: tests/test_thinking_server.py) ----


def _streamed(chat, prompt: str, text: str) -> tuple[str, str]:
    """`text` streamed a character at a time, then whole: the reasoning and content deltas joined."""
    from aerie.engine.server.chat import StreamSplitter

    splitter = StreamSplitter(chat, prompt, hold=0)
    sent = {"reasoning_content": "", "content": ""}
    for i in range(len(text) + 1):
        for key, delta in splitter.deltas(text[:i], final=i == len(text)).items():
            sent[key] += delta
    return sent["reasoning_content"], sent["content"]


def test_the_servers_chat_format_keeps_special_tags_and_streams_by_the_same_rule(qwen3):
    from aerie.engine.server.chat import ChatFormat

    chat = ChatFormat(qwen3, QWEN)  # this tokenizer makes the tags special tokens
    ids = qwen3("<think>R1 R2</think>A1<|im_end|>", add_special_tokens=False).input_ids
    text = chat.decode(ids)
    assert text == "<think>R1 R2</think>A1"  # the tags kept, the end of turn skipped
    assert ChatFormat(qwen3).decode(ids) == "R1 R2A1"  # what a decode skipping special tokens leaves
    prompt = chat.render([{"role": "user", "content": "Q"}], None)
    split = chat.split(prompt, text)
    assert (split.reasoning, split.answer) == ("R1 R2", "A1")
    assert _streamed(chat, prompt, text) == ("R1 R2", "A1")
    assert _streamed(chat, prompt, "<think>R1 cut") == ("R1 cut", "")
    assert _streamed(chat, prompt, "plain answer") == ("", "plain answer")
    no_think = chat.render([{"role": "user", "content": "Q"}], {"enable_thinking": False})
    assert no_think.endswith("<think>\n\n</think>\n\n")
    # A template that opens the block in the generation prompt: the text starts inside it.
    opened = ChatFormat(qwen3, PARSERS["qwen3-thinking"])
    assert _streamed(opened, prompt + "<think>\n", "R1</think>A1") == ("R1", "A1")
