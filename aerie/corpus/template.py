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
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from aerie.errors import DataError
from aerie.targets import TargetInfo

Messages = list[dict[str, str]]


@dataclass
class Sample:
    """One training sequence as text: `spans` are the supervised character ranges, in order."""

    text: str
    spans: list[tuple[int, int]]
    end_message: int  # index of the last message the text contains
    whole: bool  # the whole conversation (False: an extra sample for a turn rendered differently as history)


@dataclass
class TemplateSpec:
    """What a process needs to render and tokenize exactly like the target's tokenizer (picklable)."""

    chat_template: str
    template_kwargs: dict[str, Any]
    backend: Any = None  # tokenizers.Tokenizer of a fast tokenizer; None = a slow one, loaded from `target`
    target: TargetInfo | None = None  # each process loads a slow tokenizer the way the target says

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Any, *, extra_kwargs: dict[str, Any] | None = None, target: TargetInfo | None = None
    ) -> TemplateSpec:
        try:
            template = tokenizer.get_chat_template()
        except ValueError as exc:
            raise DataError(
                f"the tokenizer of {target.name if target else 'the target'} has no usable chat template ({exc}): the corpus is tokenized "
                "with the target's own template, so the target must ship one"
            ) from exc
        # apply_chat_template passes the special tokens (bos_token, eos_token, ...) to the template.
        kwargs = {**tokenizer.special_tokens_map, **(extra_kwargs or {})}
        backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer.is_fast else None
        return cls(chat_template=template, template_kwargs=kwargs, backend=backend, target=target)


class ChatRenderer:
    """Renders conversations with a chat template the way `apply_chat_template` does."""

    def __init__(self, spec: TemplateSpec) -> None:
        from transformers.utils.chat_template_utils import render_jinja_template

        self._render_many = render_jinja_template
        self.template = spec.chat_template
        self.kwargs = spec.template_kwargs

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
        never produced is not supervised.
        """
        notes: Counter[str] = Counter()
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        prompts = self.render([messages[:i] for i in turns], generation_prompt=True)
        closed = [i for i in turns if i not in truncated_turns]
        opened = [i for i in turns if i in truncated_turns]
        rendered = dict(zip(closed, self.render([messages[: i + 1] for i in closed]), strict=True))
        rendered.update(
            zip(opened, self.render([messages[: i + 1] for i in opened], open_end=True), strict=True)
        )
        spans: dict[int, tuple[int, int]] = {}
        for i, prompt in zip(turns, prompts, strict=True):
            full = rendered[i]
            start = len(prompt) if full.startswith(prompt) else len(os.path.commonprefix([prompt, full]))
            if start != len(prompt):
                notes["generation_prompt_mismatch"] += 1
            reasoning = (messages[i].get("reasoning") or "").strip()
            if reasoning and reasoning not in full[start:]:
                notes["reasoning_not_rendered"] += 1
            spans[i] = (start, len(full))
        samples: list[Sample] = []
        pending = list(turns)
        while pending:
            last = pending[-1]
            text = rendered[last]
            covered = [i for i in pending if text.startswith(rendered[i])]
            samples.append(
                Sample(text=text, spans=[spans[i] for i in covered], end_message=last, whole=not samples)
            )
            pending = [i for i in pending if i not in covered]
            if pending and len(samples) == 1:
                notes["history_rewritten_turns"] += len(pending)
            if history_mismatch == "mask":
                break
        return samples, notes


class Aligner(Protocol):
    """Tokenizes sample texts and turns their character spans into token masks."""

    def encode(self, samples: list[Sample]) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """Per sample: token ids (int32), loss mask (uint8), and the number of boundary tokens that
        straddled a span edge."""
        ...


@dataclass
class OffsetsAligner:
    """Fast tokenizers: one batched tokenization, spans located with `char_to_token`."""

    backend: Any

    def encode(self, samples: list[Sample]) -> list[tuple[np.ndarray, np.ndarray, int]]:
        encodings = self.backend.encode_batch([s.text for s in samples], add_special_tokens=False)
        return [self._one(enc, s) for enc, s in zip(encodings, samples, strict=True)]

    @staticmethod
    def _one(enc: Any, sample: Sample) -> tuple[np.ndarray, np.ndarray, int]:
        ids = np.asarray(enc.ids, dtype=np.int32)
        mask = np.zeros(len(ids), dtype=np.uint8)
        straddled = 0
        for start, end in sample.spans:
            first = _token_at(enc, start, end, step=1)
            last = _token_at(enc, end - 1, start - 1, step=-1)
            if first is None or last is None or last < first:
                continue  # the span produced no token (e.g. normalized away)
            mask[first : last + 1] = 1
            straddled += int(enc.token_to_chars(first)[0] < start) + int(enc.token_to_chars(last)[1] > end)
        return ids, mask, straddled


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

    def encode(self, samples: list[Sample]) -> list[tuple[np.ndarray, np.ndarray, int]]:
        out = []
        for s in samples:
            ids = self._ids(s.text)
            mask = np.zeros(len(ids), dtype=np.uint8)
            straddled = 0
            for start, end in s.spans:
                first, exact_first = self._boundary(ids, s.text[:start])
                last, exact_last = self._boundary(ids, s.text[:end])
                # A straddling token at the end belongs to the span: include it.
                last = last if exact_last else min(last + 1, len(ids))
                straddled += int(not exact_first) + int(not exact_last)
                mask[first:last] = 1
            out.append((np.asarray(ids, dtype=np.int32), mask, straddled))
        return out

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
