"""How `/v1/chat/completions` turns messages into a prompt and a completion into a message.

The prompt is the chat template (the tokenizer's, or `--chat-template FILE`) rendered with the
generation prompt and the request's `chat_template_kwargs` (e.g. `{"enable_thinking": false}`), as
SGLang does. With `--reasoning-parser NAME` (SGLang's names, `aerie.reasoning`) the completion is split
into `reasoning_content` and `content` by the same rule the corpus uses for inline reasoning, so a
thinking model's reasoning reaches the corpus in its own field.

A thinking model's tags may be special tokens (they are in some tokenizers), which a decode that skips
special tokens would drop: the text to split keeps the parser's tags (`TagKeepingDecoder`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aerie.engine.server.protocol import RequestError
from aerie.reasoning import ReasoningParser, Split, TagKeepingDecoder, parser_named


@dataclass
class ChatFormat:
    """The chat template and the reasoning parser of a server (both optional)."""

    tokenizer: Any
    parser: ReasoningParser | None = None
    template: str | None = None  # None: the tokenizer's own
    _decode: TagKeepingDecoder | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.parser is not None:
            self._decode = TagKeepingDecoder(self.tokenizer, self.parser)

    @classmethod
    def from_args(cls, tokenizer: Any, parser: str | None, template_path: str | None) -> ChatFormat:
        template = Path(template_path).expanduser().read_text() if template_path else None
        return cls(tokenizer, parser_named(parser) if parser else None, template)

    def render(self, messages: list[dict[str, Any]], kwargs: dict[str, Any] | None) -> str:
        """The prompt text: messages through the template, with the generation prompt."""
        extra = dict(kwargs or {})
        clash = {"messages", "add_generation_prompt", "tokenize", "chat_template"} & set(extra)
        if clash:
            raise RequestError(f"chat_template_kwargs may not set {sorted(clash)}")
        try:
            prompt = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, chat_template=self.template, **extra
            )
        except Exception as exc:  # jinja errors (e.g. a role order the template refuses) are the caller's
            raise RequestError(f"the chat template rejected the messages: {exc}") from exc
        return str(prompt)

    def decode(self, output_ids: list[int]) -> str:
        """The completion's text; with a parser, its tags kept even when they are special tokens."""
        if self._decode is None:
            return str(self.tokenizer.decode(output_ids, skip_special_tokens=True))
        return self._decode(output_ids)

    def split(self, prompt: str, text: str) -> Split:
        """The completion as reasoning and answer (all answer without a parser). A generation prompt
        that opened the reasoning block means the text starts inside it."""
        if self.parser is None:
            return Split(reasoning=None, answer=text)
        return self.parser.split(text, opened=self.parser.opened_by(prompt))


class StreamSplitter:
    """A streamed completion sent as `reasoning_content` and `content` deltas. Each call gets the whole
    text so far; until the last, what may still change is kept back: the tail of an answer that may
    become a stop string (`hold` characters), the tail of reasoning that may become the end tag, and
    all of a text that may still become the start tag (the model may be about to open its reasoning)."""

    def __init__(self, chat: ChatFormat, prompt: str, hold: int) -> None:
        self.parser = chat.parser
        self.opened = self.parser is not None and self.parser.opened_by(prompt)
        self.hold = hold
        self.sent = {"reasoning_content": 0, "content": 0}

    def deltas(self, text: str, *, final: bool = False) -> dict[str, str]:
        parser = self.parser
        if parser is None:
            return self._delta("content", text if final else _cut(text, self.hold))
        if not final and not self.opened and parser.start.startswith(text.lstrip()):
            return {}
        split = parser.split(text, opened=self.opened)
        reasoning, answer = split.reasoning or "", split.answer
        if not final:
            if split.cut:
                reasoning = _cut(reasoning, max(self.hold, len(parser.end)))
            answer = _cut(answer, self.hold)
        return {**self._delta("reasoning_content", reasoning), **self._delta("content", answer)}

    def _delta(self, key: str, text: str) -> dict[str, str]:
        sent = self.sent[key]
        if len(text) <= sent:
            return {}
        self.sent[key] = len(text)
        return {key: text[sent:]}


def _cut(text: str, hold: int) -> str:
    return text[: max(len(text) - hold, 0)]
