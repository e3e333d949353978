"""Per-conversation checks: what makes a conversation unusable for training, and why.

A conversation is usable when, after an optional system turn, roles alternate user/assistant starting
with a user, every turn has text, and at least one assistant turn remains once trailing user turns
(which nothing answers, so nothing is supervised there) are trimmed. A rejected conversation is
quarantined with a reason code (counted in the manifest) and a detail naming the message.

Reasoning: inline `<think>…</think>` in an assistant turn's content is split off by the target's
reasoning parser, or by the `<think>` convention when the content opens with the tag
(`aerie.reasoning.split_answer`), so it lands where the `reasoning` field would have put it. An
assistant turn with reasoning and no answer (cut off inside its reasoning, or one that only reasoned) is
never a complete answer: it is a truncated turn, by the same rule as an answer cut off at max_tokens.
The reasoning policy (`corpus.reasoning`) then keeps its reasoning (train; the renderer quarantines the
conversation when the template cannot render it), removes all reasoning (drop: such a turn has nothing
left and the conversation is quarantined, `reasoning_only_answer`) or quarantines any conversation
that carries reasoning (refuse).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aerie.reasoning import ReasoningParser, split_answer

ROLES = ("system", "user", "assistant")


class Rejected(Exception):
    """A conversation that cannot be used: `code` is counted, `detail` says where."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code, self.detail = code, detail


@dataclass
class Checked:
    """A conversation that passed: messages as template dicts, and which assistant turns were cut off."""

    messages: list[dict[str, str]]
    truncated_turns: frozenset[int]  # message indices of assistant turns that hit max_tokens
    trimmed: int = 0  # trailing user turns removed
    notes: Counter[str] = field(default_factory=Counter)  # what was noticed about reasoning


def _assistant_turn(
    content: str, reasoning: str | None, parser: ReasoningParser | None, notes: Counter[str]
) -> tuple[str, str | None]:
    """An assistant turn's answer and reasoning, inline reasoning split off by the target's parser."""
    split = split_answer(content, parser)
    if split.reasoning is None:
        return content, reasoning
    notes["reasoning_inline_parsed"] += 1
    if reasoning and reasoning.strip():
        # Both: the field is what the endpoint's parser returned; the inline block is dropped so the
        # template does not render a second one inside the answer.
        notes["reasoning_inline_and_field"] += 1
        return split.answer, reasoning
    return split.answer, split.reasoning


def check_conversation(
    messages: list[dict[str, Any]] | None,
    *,
    truncated: bool | None,
    finish_reasons: list[str] | None,
    truncated_policy: str,
    reasoning_policy: str = "train",
    parser: ReasoningParser | None = None,
) -> Checked:
    """Validate one conversation; raise `Rejected` with the reason if it cannot be trained on."""
    if not messages:
        raise Rejected("no_messages", "the conversation has no messages")
    out: list[dict[str, str]] = []
    notes: Counter[str] = Counter()
    unanswered: set[int] = set()  # assistant turns with reasoning and no answer
    for i, m in enumerate(messages):
        role, content, reasoning = m.get("role"), m.get("content"), m.get("reasoning")
        if role not in ROLES:
            raise Rejected("bad_role", f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
        expected = _expected_role(out)
        if role != expected and not (role == "system" and i == 0):
            raise Rejected(
                "bad_order", f"message {i} ({role}) breaks the turn order: a {expected} turn belongs there"
            )
        text = content if isinstance(content, str) else ""
        dropped = False
        if role == "assistant":
            text, reasoning = _assistant_turn(text, reasoning, parser, notes)
            reasoning = reasoning if reasoning and reasoning.strip() else None
            if reasoning is not None:
                notes["reasoning_turns"] += 1
                if reasoning_policy == "refuse":
                    raise Rejected(
                        "reasoning_refused",
                        f"message {i} (assistant) carries reasoning (corpus.reasoning=refuse)",
                    )
                if reasoning_policy == "drop":
                    notes["reasoning_dropped"] += 1
                    reasoning, dropped = None, True
                elif not text.strip():
                    # Reasoning and no answer: cut off inside it (or it only reasoned). Not a complete
                    # answer: truncated, so the end of turn it never wrote is not supervised.
                    unanswered.add(len(out))
                    text = ""
        if dropped and not text.strip():
            raise Rejected(
                "reasoning_only_answer",
                f"message {i} ({role}) has only reasoning and no final answer (corpus.reasoning=drop)",
            )
        if not text.strip() and len(out) not in unanswered:
            raise Rejected("empty_content", f"message {i} ({role}) has no text")
        msg = {"role": role, "content": text}
        if reasoning:
            msg["reasoning"] = reasoning
        out.append(msg)
    trimmed = 0
    while out and out[-1]["role"] != "assistant":
        out.pop()
        trimmed += 1
    if not any(m["role"] == "assistant" for m in out):
        raise Rejected("no_assistant_turn", "the conversation has no assistant turn to learn from")
    cut = _truncated_turns(out, bool(truncated), finish_reasons or [])
    unanswered = {i for i in unanswered if i < len(out)}
    if unanswered:
        notes["reasoning_without_answer"] += len(unanswered)
        cut = cut | frozenset(unanswered)
    if cut and truncated_policy == "drop":
        why = (
            "an assistant turn has reasoning and no answer"
            if unanswered
            else "a generation stopped at max_tokens"
        )
        raise Rejected("truncated", f"{why} (truncated_policy=drop)")
    return Checked(messages=out, truncated_turns=cut, trimmed=trimmed, notes=notes)


def _expected_role(previous: list[dict[str, str]]) -> str:
    last = previous[-1]["role"] if previous else "system"
    return "assistant" if last == "user" else "user"


def _truncated_turns(
    messages: list[dict[str, str]], truncated: bool, finish_reasons: list[str]
) -> frozenset[int]:
    """Assistant turns that stopped at max_tokens. `finish_reasons` has one entry per regenerated assistant
    turn (the last ones); without it a truncated flag means the last assistant turn."""
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if finish_reasons and len(finish_reasons) <= len(assistants):
        regenerated = assistants[len(assistants) - len(finish_reasons) :]
        return frozenset(i for i, r in zip(regenerated, finish_reasons, strict=True) if r == "length")
    return frozenset({assistants[-1]}) if truncated else frozenset()


def content_hash(messages: list[dict[str, str]], truncated_turns: frozenset[int]) -> bytes:
    """16 bytes of sha256 over the messages as trained on: the exact-duplicate key. Independent of id and
    source, so the same conversation arriving from two datasets is kept once."""
    h = hashlib.sha256()
    for i, m in enumerate(messages):
        cut = "1" if i in truncated_turns else "0"
        h.update(f"{m['role']}\x1f{cut}\x1f".encode())
        h.update(m["content"].encode())
        h.update(b"\x1f")
        h.update(m.get("reasoning", "").encode())
        h.update(b"\x1e")
    return h.digest()[:16]
