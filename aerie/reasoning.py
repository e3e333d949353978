"""Reasoning parsers: a thinking model's reasoning, split from the text it wrote around it.

A thinking model writes its reasoning between two tags before its answer (`<think>…</think>` for
Qwen3, DeepSeek-R1 and Kimi-K2/K2.5). An endpoint with a reasoning parser returns the two apart
(`reasoning_content` and `content`); one without it leaves them inline in `content`. Both the
generation servers and the corpus split inline reasoning by the same rule, under the names SGLang's
`--reasoning-parser` uses, so the parser aerie passes to SGLang is the one it applies itself.

The rule (`ReasoningParser.split`): leading start tags are dropped; the text before the first end tag
is the reasoning and the text after it the answer; a start tag (or a prompt that opened the block)
without an end tag means the model was cut off inside its reasoning: all of it is reasoning and there
is no answer. Text with neither tag is all answer.

Reasoning-only answers, one rule wherever they arrive (the `reasoning` field, `<think>…</think>` in
`content`, or a block cut off before its end tag): a turn's answer is its content once its reasoning is
split off (`split_answer`: by the target's parser; with none, by the `<think>` convention when the
content starts with the start tag, since no answer does). A turn whose answer is then blank has no
answer to learn: generation refuses it (`empty_answer`), never stores it and never sends it back as
history; the merge keeps it only as a truncated turn whose reasoning is supervised, and quarantines
its conversation (`reasoning_only_answer`) when the reasoning is dropped or the template cannot render
it (only an end of turn would be supervised).

Which parser a target takes is read from its architecture and chat template (`parser_for`): a
template that never writes the parser's end tag is not a thinking model's, whatever its family.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aerie.errors import ConfigError


@dataclass(frozen=True)
class Split:
    """Text split at its reasoning. `reasoning` is None when there was none; `cut` when the text ended
    inside the reasoning block (no end tag), so there is no answer."""

    reasoning: str | None
    answer: str
    cut: bool = False


@dataclass(frozen=True)
class ReasoningParser:
    """One convention: the tags around the reasoning. `opens`: the model starts inside its reasoning
    without writing the start tag (DeepSeek-R1's template opens the block in the prompt)."""

    name: str
    start: str
    end: str
    opens: bool = False

    def split(self, text: str, *, opened: bool = False) -> Split:
        """Split `text`, a whole completion. `opened`: the prompt already opened the reasoning block
        (its generation prompt ends with the start tag), so the text starts inside it."""
        rest = text.lstrip()
        started = opened or self.opens
        while rest.startswith(self.start):
            rest = rest[len(self.start) :]
            started = True
        if self.end in rest:
            reasoning, answer = rest.split(self.end, 1)
            return Split(reasoning=reasoning, answer=answer)
        if started:
            return Split(reasoning=rest, answer="", cut=True)
        return Split(reasoning=None, answer=text)

    def opened_by(self, prompt: str) -> bool:
        """Whether a rendered generation prompt leaves the model inside the reasoning block."""
        tail = prompt.rstrip()
        return tail.endswith(self.start) and not tail.endswith(self.start + self.end)


_THINK = ("<think>", "</think>")

# The names are SGLang's (`--reasoning-parser`, sglang/srt/parser/reasoning_parser.py); only the
# conventions of the targets aerie knows are listed.
PARSERS: dict[str, ReasoningParser] = {
    p.name: p
    for p in (
        ReasoningParser("qwen3", *_THINK),
        ReasoningParser("qwen3-thinking", *_THINK, opens=True),
        ReasoningParser("deepseek-r1", *_THINK, opens=True),
        ReasoningParser("kimi_k2", *_THINK),
        ReasoningParser("kimi", "◁think▷", "◁/think▷"),
    )
}

# The start tags recognised in a content even without a parser (`split_answer`).
_CONVENTIONS = (PARSERS["qwen3"], PARSERS["kimi"])

# Architecture prefixes (config.json `architectures[0]`) and the parser of their thinking models.
_BY_ARCHITECTURE = (
    ("Qwen3", "qwen3"),
    ("KimiK2", "kimi_k2"),
    ("KimiK25", "kimi_k2"),
    ("KimiVL", "kimi"),
    ("DeepseekV3", "deepseek-r1"),
    ("DeepseekV32", "deepseek-r1"),
)
# Kimi-K2 thinking checkpoints are DeepseekV3 architectures: their template's turn markers tell them apart.
_KIMI_MARKER = "<|im_assistant|>"


def split_answer(text: str, parser: ReasoningParser | None) -> Split:
    """A turn's content split into reasoning and answer by the target's `parser`; with none (a template
    that is not a thinking one, an endpoint aerie knows nothing of), by a convention aerie knows when the
    content starts with its start tag: an answer never opens with `<think>`, a reasoning block does."""
    if parser is not None:
        return parser.split(text)
    head = text.lstrip()
    for convention in _CONVENTIONS:
        if head.startswith(convention.start):
            return convention.split(text)
    return Split(reasoning=None, answer=text)


def parser_named(name: str) -> ReasoningParser:
    try:
        return PARSERS[name]
    except KeyError:
        raise ConfigError(
            f"unknown reasoning parser {name!r}; aerie knows {', '.join(PARSERS)} (SGLang's names)"
        ) from None


def parser_for(architecture: str, chat_template: str, setting: str = "auto") -> ReasoningParser | None:
    """The parser of a target: `setting` names one, "none" turns parsing off, "auto" reads the target's
    family, falling back to the `<think>` convention for any template that writes `</think>`. None:
    not a thinking model (its template never writes the end tag)."""
    if setting == "none":
        return None
    if setting != "auto":
        return parser_named(setting)
    name = None
    for prefix, family in _BY_ARCHITECTURE:
        if architecture.startswith(prefix):
            name = family
    if name == "deepseek-r1" and _KIMI_MARKER in chat_template:
        name = "kimi_k2"
    if name is None and _THINK[1] in chat_template:
        name = "qwen3"
    if name is None:
        return None
    found = PARSERS[name]
    return found if found.end in chat_template else None


class TagKeepingDecoder:
    """Token ids to text with the parser's tags kept: a thinking model's tags may be special tokens
    (they are in some tokenizers), which a decode that skips special tokens would drop; the other
    special tokens (end of turn, ...) are skipped as usual."""

    def __init__(self, tokenizer: Any, parser: ReasoningParser) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        tags = {int(vocab[t]) for t in (parser.start, parser.end) if t in vocab}
        special = set(tokenizer.all_special_ids) | {
            int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special
        }
        self.skipped = frozenset(special - tags)

    def __call__(self, ids: Sequence[int]) -> str:
        kept = [int(t) for t in ids if int(t) not in self.skipped]
        return str(self.tokenizer.decode(kept, skip_special_tokens=False))


def inside_reasoning(
    decode: Callable[[Sequence[int]], str],
    parser: ReasoningParser,
    output_ids: Sequence[int],
    positions: Sequence[int],
    *,
    opened: bool = False,
) -> list[bool]:
    """For each position of a completion: whether the text before it ends inside the reasoning block
    (by `ReasoningParser.split`'s rule), i.e. whether the token there is reasoning. `opened`: the prompt
    opened the block."""
    return [parser.split(decode(output_ids[:p]), opened=opened).cut for p in positions]


def read_template(path: str, setting: str = "corpus.chat_template") -> str:
    """A chat template file's text (`corpus.chat_template`: the corpus, the generation server and the
    evaluation prompts all render with it); ConfigError naming the setting when it cannot be read."""
    from pathlib import Path

    where = Path(path).expanduser()
    try:
        text = where.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{setting}: cannot read {where}: {exc}") from exc
    if not text.strip():
        raise ConfigError(f"{setting}: {where} is empty")
    return text


def reasoning_line(figures: dict[str, Any]) -> str | None:
    """The run summary's line on reasoning, from a merge's figures; None when the data has none."""
    total = int(figures.get("reasoning_tokens") or 0)
    if not total:
        return None
    supervised = int(figures.get("reasoning_tokens_supervised") or 0)
    line = f"reasoning tokens supervised: {supervised:,} of {total:,} ({supervised / total:.1%})"
    warning = reasoning_warning(total, supervised)
    return f"{line}; WARNING: {warning}" if warning else line


def reasoning_warning(total: int, supervised: int, policy: str = "train") -> str | None:
    """Reasoning in the data and none of it supervised, when the policy meant to train on it: a drafter
    that never saw a reasoning token accepts little of a thinking model's output."""
    if total and not supervised and policy == "train":
        return (
            f"the data holds {total:,} reasoning tokens and none is supervised: the chat template renders "
            "no reasoning and aerie found no think block to put it in (see docs/thinking.md: "
            "corpus.chat_template, corpus.reasoning_parser)"
        )
    return None
