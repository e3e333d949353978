"""Per-conversation checks: what makes a conversation unusable for training, and why.

A conversation is usable when, after an optional system turn, roles alternate user/assistant starting
with a user, every turn has text (an assistant turn has a final answer, not only reasoning), and at least one assistant turn remains once trailing user turns
(which nothing answers, so nothing is supervised there) are trimmed. A rejected conversation is
quarantined with a reason code (counted in the manifest) and a detail naming the message.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

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


def check_conversation(
    messages: list[dict[str, Any]] | None,
    *,
    truncated: bool | None,
    finish_reasons: list[str] | None,
    truncated_policy: str,
) -> Checked:
    """Validate one conversation; raise `Rejected` with the reason if it cannot be trained on."""
    if not messages:
        raise Rejected("no_messages", "the conversation has no messages")
    out: list[dict[str, str]] = []
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
        if not text.strip():
            # Reasoning alone is not an answer: training on it would teach an empty assistant turn
            # (and a template without a reasoning field would render nothing at all there).
            only = role == "assistant" and reasoning and reasoning.strip()
            has = "only reasoning and no final answer" if only else "no text"
            raise Rejected("empty_content", f"message {i} ({role}) has {has}")
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
    if cut and truncated_policy == "drop":
        raise Rejected("truncated", "a generation stopped at max_tokens (truncated_policy=drop)")
    return Checked(messages=out, truncated_turns=cut, trimmed=trimmed)


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
