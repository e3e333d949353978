"""Evaluation on a thinking target: acceptance reported apart for reasoning and answer rounds.

The speculative decoder records each verify round; a round is reasoning when the text before its start
ends inside the think block. On tests/thinking_target.py (greedy output `<think>Let me think</think>Hi`,
known in advance) the rounds are classified as the output says, their counts add up to the whole, and
the figures carry `_reasoning` / `_answer`; with `enable_thinking: false` in the prompt format no
round is reasoning. A crafted case covers a template that opens the block in the prompt."""

from __future__ import annotations

import pytest

from aerie.engine.speculative.decoder import SpecOutput
from aerie.evaluate.config import EvaluateConfig, PromptFormat
from aerie.evaluate.prompts import EvalPrompt, chat_prompt_ids, prompt_tokenizer
from aerie.evaluate.reasoning_split import ReasoningReader, format_key, reader_for
from aerie.evaluate.work import _figures, key_of, measure_setting
from aerie.reasoning import PARSERS, TagKeepingDecoder, inside_reasoning
from aerie.targets import resolve_target
from tests.thinking_target import ANSWER, QWEN3_TEMPLATE, REASONING, THINK_TAGS, build_thinking_target


@pytest.fixture(scope="module")
def thinker(smollm2, tmp_path_factory):
    return resolve_target(str(build_thinking_target(tmp_path_factory.mktemp("thinker") / "target", smollm2)))


# The question quotes the reasoning, so prompt lookup drafts it once the model opens its block: the
# reasoning rounds accept drafts, the answer rounds none (the answer is nowhere in the context).
QUESTION = f"Say <think>{REASONING}"


def _measure(thinker, fmt: PromptFormat, k: int = 3) -> dict:
    cfg = EvaluateConfig(
        proposers=["prompt_lookup"], num_steps=[k], temperatures=[0.0], max_new_tokens=16, prompt_format=fmt
    )
    tok = prompt_tokenizer(thinker.load_tokenizer(), QWEN3_TEMPLATE.read_text(), fmt.chat_template_kwargs)
    # Three copies of one prompt, decoded as a batch: each must be decoded as it is alone.
    prompts = [EvalPrompt(f"q{i}", "think", chat_prompt_ids(tok, QUESTION), QUESTION) for i in range(3)]
    loaded = {"model": thinker.load_model("cpu", "float32")}
    return measure_setting(cfg, loaded, thinker, "think", prompts, "prompt_lookup", (k, 0.0), lambda n: None)


def test_rounds_are_split_into_reasoning_and_answer_and_add_up(thinker):
    fmt = PromptFormat(chat_template=str(QWEN3_TEMPLATE))
    part = _measure(thinker, fmt)
    result = part["result"]
    tok = thinker.load_tokenizer()
    decode = TagKeepingDecoder(tok, PARSERS["qwen3"])
    reasoning_end = len(tok("<think>" + REASONING + "</think>", add_special_tokens=False).input_ids)
    expected = {"reasoning": [0, 0], "answer": [0, 0]}  # rounds, tokens
    for row in part["per_prompt"]:
        assert row["completion_tokens"] == reasoning_end + 2  # ... Hi <|im_end|>
    reader = reader_for(fmt, thinker)
    assert reader is not None and reader.parser.name == "qwen3"
    # Rerun one prompt by hand to see its rounds: each classified by where it starts in the known output.
    from aerie.engine.speculative.decoder import SpecDecoder
    from aerie.engine.speculative.prompt_lookup import PromptLookupProposer

    model = thinker.load_model("cpu", "float32")
    prompt = chat_prompt_ids(prompt_tokenizer(tok, QWEN3_TEMPLATE.read_text(), {}), QUESTION)
    out = SpecDecoder(
        model, PromptLookupProposer(3, 1), num_steps=3, eos_token_ids=thinker.eos_token_ids
    ).generate([prompt], 16)[0]
    assert decode(out.output_ids) == f"<think>{REASONING}</think>{ANSWER}"
    kinds = reader.kinds(prompt, out)
    assert kinds == ["reasoning" if start < reasoning_end else "answer" for start, _ in out.rounds]
    for kind, (start, _), emitted in zip(kinds, out.rounds, out.round_tokens(), strict=True):
        expected[kind][0] += 1
        expected[kind][1] += emitted
        assert start >= 1  # the prefill's token is no round's
    assert sum(out.round_tokens()) == out.completion_tokens - 1 and len(out.rounds) == out.verify_ct
    # The measurement's split: three prompts decoded alike, and the kinds partition the rounds.
    for kind in ("reasoning", "answer"):
        assert result[kind]["rounds"] == 3 * expected[kind][0] > 0
        assert result[kind]["tokens"] == 3 * expected[kind][1]
    assert result["reasoning"]["rounds"] + result["answer"]["rounds"] == result["spec_verify_ct"]
    tokens = result["reasoning"]["tokens"] + result["answer"]["tokens"]
    assert tokens == result["completion_tokens"] - result["sequences"]
    assert result["reasoning"]["accept_length"] > 1.0 == result["answer"]["accept_length"]
    figures = _figures([result], {"think": []}, {"identical": 0, "compared": 0})
    assert figures["accept_think_prompt_lookup_k3_reasoning"] == result["reasoning"]["accept_length"]
    assert figures["accept_think_prompt_lookup_k3_answer"] == result["answer"]["accept_length"]
    from aerie.evaluate.report import reasoning_section

    table = "\n".join(reasoning_section([result]))
    assert f"| think | prompt_lookup | 3 | 0 | {result['reasoning']['accept_length']:.2f} |" in table


def test_without_thinking_no_round_is_reasoning(thinker):
    fmt = PromptFormat(chat_template=str(QWEN3_TEMPLATE), chat_template_kwargs={"enable_thinking": False})
    result = _measure(thinker, fmt)["result"]
    assert result["completion_tokens"] == 3 * 2  # Hi <|im_end|>
    assert result["reasoning"] == {"rounds": 0, "tokens": 0, "accept_length": None}
    assert result["answer"]["rounds"] == result["spec_verify_ct"] == 3


def test_a_prompt_that_opened_the_block_starts_inside_the_reasoning(smollm2):
    """A crafted case (qwen3-thinking's convention: the generation prompt ends with `<think>`)."""
    tok = smollm2.load_tokenizer()
    tok.add_tokens(THINK_TAGS, special_tokens=True)
    parser = PARSERS["qwen3-thinking"]
    decode = TagKeepingDecoder(tok, parser)
    ids = tok("plan it</think>done<|im_end|>", add_special_tokens=False).input_ids
    end = ids.index(tok.convert_tokens_to_ids("</think>"))
    inside = inside_reasoning(decode, parser, ids, range(len(ids)), opened=True)
    assert inside == [i <= end for i in range(len(ids))]
    prompt = tok("<|im_start|>assistant\n<think>\n", add_special_tokens=False).input_ids
    out = SpecOutput(ids, "stop", verify_ct=2, reached=[], accepted=[], rounds=[(1, 2), (end + 1, 0)])
    assert ReasoningReader(parser, decode).kinds(prompt, out) == ["reasoning", "answer"]
    # The same text after a prompt that did not open it: a qwen3 parser sees no reasoning at all.
    assert ReasoningReader(PARSERS["qwen3"], TagKeepingDecoder(tok, PARSERS["qwen3"])).kinds([1], out) == [
        "answer",
        "answer",
    ]


def test_the_prompt_format_enters_the_key_only_when_set(thinker, tmp_path):
    from aerie.manifest import StageResult

    up = StageResult(
        stage="x", key="k", prefix="p", manifest_uri="u", manifest_sha256="s", cache_hit=False, seconds=0.0
    )
    plain = EvaluateConfig()
    assert format_key(plain.prompt_format) == []
    assert "prompt_format" not in repr(plain)  # the key hashes the repr: unchanged at the default
    template = tmp_path / "t.jinja"
    template.write_text(QWEN3_TEMPLATE.read_text())
    fmt = PromptFormat(chat_template=str(template))
    assert key_of(plain.model_copy(update={"prompt_format": fmt}), thinker, up, up) != key_of(
        plain, thinker, up, up
    )
    template.write_text(QWEN3_TEMPLATE.read_text() + "\n")
    other = format_key(fmt)
    assert other != format_key(PromptFormat(chat_template=str(QWEN3_TEMPLATE)))  # by content, not path


def test_a_pipeline_evaluates_with_the_corpus_prompt_format():
    from aerie.config import PipelineConfig
    from aerie.errors import ConfigError
    from aerie.evaluate.stage import evaluate_config

    assert evaluate_config(PipelineConfig()).prompt_format == PromptFormat()
    cfg = PipelineConfig().model_copy(deep=True)
    cfg.corpus.chat_template = str(QWEN3_TEMPLATE)
    cfg.corpus.chat_template_kwargs = {"enable_thinking": False}
    fmt = evaluate_config(cfg).prompt_format
    assert (fmt.chat_template, fmt.chat_template_kwargs) == (str(QWEN3_TEMPLATE), {"enable_thinking": False})
    cfg.evaluate.prompt_format = PromptFormat(reasoning_parser="none")
    with pytest.raises(ConfigError, match="differs from the corpus"):
        evaluate_config(cfg)
