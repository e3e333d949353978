"""Acceptance on a thinking model's reasoning and on its answers, apart.

Most of what a thinking model generates is reasoning: whether the drafter learned it shows only when
the two are measured apart. The decoder records each verify round (where in the output it started, how
many drafts it accepted); a round counts as reasoning when the text before its start ends inside the
reasoning block, by the target's reasoning parser (`aerie.reasoning`, the corpus's rule), the prompt
included (a template that opens the block in the generation prompt). The two sets of rounds partition
all of them, so their rounds and tokens add up to the whole measurement's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aerie.evaluate.config import PromptFormat
from aerie.reasoning import ReasoningParser, TagKeepingDecoder, inside_reasoning, parser_for, read_template
from aerie.targets import TargetInfo

if TYPE_CHECKING:
    from aerie.engine.speculative.decoder import SpecOutput

KINDS = ("reasoning", "answer")


def prompt_template(fmt: PromptFormat) -> str | None:
    """The override template's text (None: the target's own)."""
    return read_template(fmt.chat_template, "chat_template") if fmt.chat_template else None


def format_key(fmt: PromptFormat) -> list[str]:
    """What the prompt format adds to the stage key: nothing at its default (keys stay as they were);
    else its settings, the template by its content's hash."""
    if fmt == PromptFormat():
        return []
    template = prompt_template(fmt)
    digest = hashlib.sha256(template.encode()).hexdigest() if template is not None else None
    settings = fmt.model_dump(mode="json", exclude={"chat_template"})
    return [f"prompt-format:{digest}:{sorted(settings.items())}"]


@dataclass(frozen=True)
class ReasoningReader:
    """What tells a completion's reasoning from its answer: the parser and a decode that keeps its tags."""

    parser: ReasoningParser
    decode: TagKeepingDecoder

    def kinds(self, prompt_ids: Sequence[int], out: SpecOutput) -> list[str]:
        """The kind of each verify round of `out`, in order."""
        opened = self.parser.opened_by(self.decode(prompt_ids))
        starts = [start for start, _ in out.rounds]
        inside = inside_reasoning(self.decode, self.parser, out.output_ids, starts, opened=opened)
        return [KINDS[0] if flag else KINDS[1] for flag in inside]


def reader_for(fmt: PromptFormat, target: TargetInfo) -> ReasoningReader | None:
    """The reader of a thinking target; None when the target is not one (or parsing is off)."""
    if fmt.reasoning_parser == "none":
        return None
    tokenizer = target.load_tokenizer()
    template = prompt_template(fmt)
    if template is None:
        try:
            template = str(tokenizer.get_chat_template())
        except ValueError:  # no template at all: not a thinking model's
            template = ""
    parser = parser_for(target.geometry.architecture, template, fmt.reasoning_parser)
    return None if parser is None else ReasoningReader(parser, TagKeepingDecoder(tokenizer, parser))


@dataclass
class SplitCounts:
    """Verify rounds and the tokens they emitted, by kind."""

    rounds: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def add(self, kinds: Sequence[str], out: SpecOutput) -> None:
        for kind, emitted in zip(kinds, out.round_tokens(), strict=True):
            self.rounds[kind] += 1
            self.tokens[kind] += emitted

    def to_dict(self) -> dict[str, Any]:
        """Per kind: rounds, tokens, and the acceptance length (tokens per verify round, bonus included,
        as `SpecStats.accept_length`; None without a round of that kind)."""
        return {
            kind: {
                "rounds": self.rounds[kind],
                "tokens": self.tokens[kind],
                "accept_length": round(self.tokens[kind] / self.rounds[kind], 4)
                if self.rounds[kind]
                else None,
            }
            for kind in KINDS
        }
