"""Loss masks derived from the target's own chat template, with no hand-written header strings.

For assistant turn i the template is rendered twice: the conversation before it with the generation
prompt (what the server sends the model: P_i) and the conversation up to and including it (F_i). The
text F_i adds after the common prefix of P_i and F_i is what the model produced: its answer,
reasoning as the template renders it, and the template's end-of-turn. These are character spans of the
rendered sample; the tokenizer maps them to tokens.

Why spans and one tokenization instead of tokenizing every prefix: tokenizing P_i and F_i separately
costs a tokenization per turn (quadratic in turns) while the token-level difference is the same unless
a token straddles a boundary. A fast tokenizer answers "which token holds character c" directly
(`Encoding.char_to_token`), so each sample is tokenized once; a token that straddles a boundary is
detected there (its characters start before the span) and counted. It is supervised, as
`apply_chat_template(return_assistant_tokens_mask=True)` does. Tokenizers without offsets (slow,
e.g. tiktoken-based) take `PrefixAligner`: the prefix up to each boundary is tokenized and checked
to be a token prefix of the sample.

Templates that render history differently from the turn being generated (Qwen3-style templates drop
old reasoning) make F_i not a prefix of the whole conversation. Such turns get their own sample
(`history_mismatch="split"`), rendered exactly as the server saw it, or are left unsupervised ("mask").

Reasoning is located by rendering, never by template name: a turn's reasoning is looked for in what
F_i adds. Some templates (Kimi-K2.5's) blank the reasoning of every finished assistant turn, the last
one included, with an empty `<think></think>`; when the reasoning is not rendered and the target's
reasoning parser finds that empty block (or a generation prompt that opened it), the reasoning is put
back in it: P_i plus what the model wrote after it, reasoning first. Such a turn is then not a prefix of
the whole conversation either, so it gets its own sample like any rewritten turn, and each turn's
reasoning is supervised exactly once. A turn cut off inside its reasoning ends where its reasoning
ends: the end tag it never wrote is not supervised. Such a turn whose reasoning the template neither
renders nor leaves a block for has nothing to supervise but an end of turn it never wrote: its
conversation is quarantined (`reasoning_only_answer`, aerie.reasoning's rule).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from aerie.corpus.validate import Rejected
from aerie.errors import DataError
from aerie.reasoning import ReasoningParser
from aerie.targets import TargetInfo

Messages = list[dict[str, str]]


@dataclass
class Sample:
    """One training sequence as text: `spans` are the supervised character ranges, in order."""

    text: str
    spans: list[tuple[int, int]]
    end_message: int  # index of the last message the text contains
    whole: bool  # the whole conversation (False: an extra sample for a turn rendered differently as history)
    reasoning_spans: list[tuple[int, int]] = field(default_factory=list)  # its turns' reasoning, as rendered
    unrendered: list[str] = field(default_factory=list)  # reasoning no sample renders (counted, not trained)


@dataclass
class Encoded:
    """One tokenized sample: ids, loss mask, the tokens that straddled a span edge, and which tokens
    belong to its reasoning spans."""

    ids: np.ndarray
    mask: np.ndarray
    straddled: int
    reasoning: np.ndarray


@dataclass
class TemplateSpec:
    """What a process needs to render and tokenize exactly like the target's tokenizer (picklable)."""

    chat_template: str
    template_kwargs: dict[str, Any]
    backend: Any = None  # tokenizers.Tokenizer of a fast tokenizer; None = a slow one, loaded from `target`
    target: TargetInfo | None = None  # each process loads a slow tokenizer the way the target says
    parser: ReasoningParser | None = None  # the target's reasoning convention; None = not a thinking model

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Any,
        *,
        extra_kwargs: dict[str, Any] | None = None,
        target: TargetInfo | None = None,
        template: str | None = None,
        parser: ReasoningParser | None = None,
    ) -> TemplateSpec:
        """The target's template (or `template`, an override) with its special tokens and `extra_kwargs`."""
        if template is None:
            try:
                template = tokenizer.get_chat_template()
            except ValueError as exc:
                raise DataError(
                    f"the tokenizer of {target.name if target else 'the target'} has no usable chat template ({exc}): the corpus is tokenized "
                    "with the target's own template, so the target must ship one (or set corpus.chat_template)"
                ) from exc
        # apply_chat_template passes the special tokens (bos_token, eos_token, ...) to the template.
        kwargs = {**tokenizer.special_tokens_map, **(extra_kwargs or {})}
        backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
        return cls(
            chat_template=str(template), template_kwargs=kwargs, backend=backend, target=target, parser=parser
        )


class ChatRenderer:
    """Renders conversations with a chat template the way `apply_chat_template` does."""

    def __init__(self, spec: TemplateSpec) -> None:
        from transformers.utils.chat_template_utils import render_jinja_template

        self._render_many = render_jinja_template
        self.template = spec.chat_template
        self.kwargs = spec.template_kwargs
        self.parser = spec.parser

    def render(
        self, chats: list[Messages], *, generation_prompt: bool = False, open_end: bool = False
    ) -> list[str]:
        if not chats:
            return []
        # transformers annotates it as returning str; it returns (rendered chats, generation indices).
        result: Any = self._render_many(
            chats,
            chat_template=self.template,
            add_generation_prompt=generation_prompt,
            continue_final_message=open_end,
            **self.kwargs,
        )
        return list(result[0])

    def samples(
        self, messages: Messages, truncated_turns: frozenset[int], history_mismatch: str
    ) -> tuple[list[Sample], Counter[str]]:
        """The training samples of one conversation and what was noticed while deriving them.

        `truncated_turns` are rendered open-ended (`continue_final_message`), so the end-of-turn the model
        never produced is not supervised; one without an answer (cut off inside its reasoning) ends
        where its reasoning ends.
        """
        notes: Counter[str] = Counter()
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        prompts = dict(
            zip(turns, self.render([messages[:i] for i in turns], generation_prompt=True), strict=True)
        )
        opened = [i for i in turns if i in truncated_turns and messages[i]["content"]]
        closed = [i for i in turns if i not in opened]
        rendered = dict(zip(closed, self.render([messages[: i + 1] for i in closed]), strict=True))
        rendered.update(
            zip(opened, self.render([messages[: i + 1] for i in opened], open_end=True), strict=True)
        )
        spans: dict[int, tuple[int, int]] = {}
        thought: dict[int, tuple[int, int]] = {}  # turn -> its reasoning's span in rendered[turn]
        unrendered: list[str] = []
        for i in turns:
            prompt, full = prompts[i], rendered[i]
            start = len(prompt) if full.startswith(prompt) else len(os.path.commonprefix([prompt, full]))
            if start != len(prompt):
                notes["generation_prompt_mismatch"] += 1
            reasoning = messages[i].get("reasoning") or ""
            if reasoning.strip():
                placed = self._place_reasoning(full, start, reasoning)
                if placed is None:
                    if i in truncated_turns and not messages[i]["content"]:
                        raise Rejected(
                            "reasoning_only_answer",
                            f"message {i} (assistant) has only reasoning, which the chat template does not "
                            "render: only an end of turn would be supervised (see corpus.chat_template, "
                            "corpus.reasoning_parser)",
                        )
                    notes["reasoning_not_rendered"] += 1
                    unrendered.append(reasoning)
                else:
                    full, thought[i], put_back = placed
                    notes["reasoning_put_back"] += int(put_back)
                    if i in truncated_turns and not messages[i]["content"]:
                        full = full[: thought[i][1]]  # cut off inside its reasoning: nothing after it
            rendered[i] = full
            spans[i] = (start, len(full))
        samples: list[Sample] = []
        pending = list(turns)
        while pending:
            last = pending[-1]
            text = rendered[last]
            covered = [i for i in pending if text.startswith(rendered[i])]
            samples.append(
                Sample(
                    text=text,
                    spans=[spans[i] for i in covered],
                    end_message=last,
                    whole=not samples,
                    reasoning_spans=[thought[i] for i in covered if i in thought],
                )
            )
            pending = [i for i in pending if i not in covered]
            if pending and len(samples) == 1:
                notes["history_rewritten_turns"] += len(pending)
            if history_mismatch == "mask":
                break
        # Reasoning that no sample supervises is still part of the data: counted with the whole sample.
        unrendered += [messages[i]["reasoning"] for i in pending if i in thought]
        samples[0].unrendered = unrendered
        return samples, notes

    def _place_reasoning(
        self, full: str, start: int, reasoning: str
    ) -> tuple[str, tuple[int, int], bool] | None:
        """Where a turn's reasoning is in `full` (rendered from `start` on): the text, the reasoning's span,
        and whether it was put back into a block the template left empty. None: neither rendered nor an
        empty block to put it in."""
        needle = reasoning.strip()
        parser = self.parser
        # Rendered reasoning comes before the end tag: an answer that repeats it does not count.
        closing = full.find(parser.end, start) if parser is not None else -1
        at = full.find(needle, start, closing + len(needle) if closing >= 0 else len(full))
        if at >= 0:
            return full, (at, at + len(needle)), False
        if parser is None:
            return None
        if parser.opened_by(full[:start]) and full[start:].lstrip().startswith(parser.end):
            # The generation prompt opened the block and the template closes it at once.
            return full[:start] + reasoning + full[start:], (start, start + len(reasoning)), True
        empty = re.compile(re.escape(parser.start) + r"\s*" + re.escape(parser.end)).search(full, start)
        if empty is None:
            return None
        at = empty.start() + len(parser.start)
        text = full[:at] + reasoning + full[empty.end() - len(parser.end) :]
        return text, (at, at + len(reasoning)), True


class Aligner(Protocol):
    """Tokenizes sample texts and turns their character spans into token masks."""

    def encode(self, samples: list[Sample]) -> list[Encoded]:
        """Per sample: token ids (int32), loss mask (uint8), the number of boundary tokens that
        straddled a span edge, and the tokens of its reasoning spans (uint8)."""
        ...

    def count(self, texts: list[str]) -> int:
        """Tokens of `texts`, each tokenized alone."""
        ...


@dataclass
class OffsetsAligner:
    """Fast tokenizers: one batched tokenization, spans located with `char_to_token`."""

    backend: Any

    def encode(self, samples: list[Sample]) -> list[Encoded]:
        encodings = self.backend.encode_batch([s.text for s in samples], add_special_tokens=False)
        return [self._one(enc, s) for enc, s in zip(encodings, samples, strict=True)]

    def count(self, texts: list[str]) -> int:
        if not texts:
            return 0
        return sum(len(e.ids) for e in self.backend.encode_batch(texts, add_special_tokens=False))

    @classmethod
    def _one(cls, enc: Any, sample: Sample) -> Encoded:
        ids = np.asarray(enc.ids, dtype=np.int32)
        mask, straddled = cls._mask(enc, len(ids), sample.spans)
        reasoning, _ = cls._mask(enc, len(ids), sample.reasoning_spans)
        return Encoded(ids, mask, straddled, reasoning)

    @staticmethod
    def _mask(enc: Any, n: int, spans: list[tuple[int, int]]) -> tuple[np.ndarray, int]:
        mask = np.zeros(n, dtype=np.uint8)
        straddled = 0
        for start, end in spans:
            first = _token_at(enc, start, end, step=1)
            last = _token_at(enc, end - 1, start - 1, step=-1)
            if first is None or last is None or last < first:
                continue  # the span produced no token (e.g. normalized away)
            mask[first : last + 1] = 1
            straddled += int(enc.token_to_chars(first)[0] < start) + int(enc.token_to_chars(last)[1] > end)
        return mask, straddled


def _token_at(enc: Any, pos: int, stop: int, *, step: int) -> int | None:
    """The token holding character `pos`, walking towards `stop` past characters that map to no token
    (offsets trimmed of spaces, characters a normalizer removed)."""
    while pos != stop:
        token = enc.char_to_token(pos)
        if token is not None:
            return int(token)
        pos += step
    return None


@dataclass
class PrefixAligner:
    """Tokenizers without offsets: the token-level difference of prefixes, checked for consistency."""

    tokenizer: Any
    _cache: dict[str, list[int]] = field(default_factory=dict)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def count(self, texts: list[str]) -> int:
        return sum(len(self._ids(t)) for t in texts)

    def encode(self, samples: list[Sample]) -> list[Encoded]:
        out = []
        for s in samples:
            ids = self._ids(s.text)
            mask, straddled = self._mask(ids, s.text, s.spans)
            reasoning, _ = self._mask(ids, s.text, s.reasoning_spans)
            out.append(Encoded(np.asarray(ids, dtype=np.int32), mask, straddled, reasoning))
        return out

    def _mask(self, ids: list[int], text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, int]:
        mask = np.zeros(len(ids), dtype=np.uint8)
        straddled = 0
        for start, end in spans:
            first, exact_first = self._boundary(ids, text[:start])
            last, exact_last = self._boundary(ids, text[:end])
            # A straddling token at the end belongs to the span: include it.
            last = last if exact_last else min(last + 1, len(ids))
            straddled += int(not exact_first) + int(not exact_last)
            mask[first:last] = 1
        return mask, straddled

    def _boundary(self, ids: list[int], prefix: str) -> tuple[int, bool]:
        """How many leading tokens of `ids` the prefix text accounts for, and whether exactly."""
        head = self._ids(prefix)
        n = 0
        limit = min(len(head), len(ids))
        while n < limit and head[n] == ids[n]:
            n += 1
        return n, n == len(head)


def make_aligner(spec: TemplateSpec) -> Aligner:
    if spec.backend is not None:
        return OffsetsAligner(spec.backend)
    if spec.target is None:
        raise DataError(
            "a tokenizer without offsets (a slow one) needs its target so each worker can load it"
        )
    return PrefixAligner(spec.target.load_tokenizer())
