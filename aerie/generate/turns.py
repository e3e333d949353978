"""Turn-by-turn regeneration of one conversation (SpecForge and speculators do the same).

A drafter learns the *target's* outputs, so the data's assistant turns are dropped and, for every user
turn, the target answers given the regenerated history so far: multi-turn data stays on-policy. The
history sent back holds only visible answers; a thinking model's reasoning is stored beside each turn
but never fed back (the providers ask for that, and it is what the model sees when serving). An
endpoint without a reasoning parser leaves a `<think>` block inline in `content`: it is split off here
(`aerie.reasoning.split_answer`) into the turn's reasoning, and an answer that is only reasoning, in
either place, is refused (`empty_answer`): aerie.reasoning states the rule.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from aerie.conversation import Conversation, Message
from aerie.errors import RequestFailedError
from aerie.generate.client import ChatClient, Completion
from aerie.generate.config import DatasetSpec, SamplingParams
from aerie.reasoning import split_answer


class EmptyAnswerError(RequestFailedError):
    """The endpoint answered, but with no visible text (all of it reasoning, or whitespace): nothing a
    drafter could learn the answer from. The conversation fails (never a good sample with an empty
    turn); what reasoning came back is kept on the error, in its own field, for the error record."""

    def __init__(self, message: str, attempts: int, *, reasoning: str | None, finish_reason: str) -> None:
        super().__init__("empty_answer", message, attempts)
        self.reasoning, self.finish_reason = reasoning, finish_reason


@dataclass(frozen=True)
class Prepared:
    """A conversation ready to generate: the messages to send (regenerate) or to keep as they are."""

    id: str
    source: str
    messages: tuple[Message, ...]

    @property
    def input_sha256(self) -> str:
        """What the conversation was generated from: its turns as sent (or kept), in order. A record
        resumes only under the same id *and* this digest, so a prompt (or a kept answer) edited in
        place is generated again instead of keeping what the old text gave."""
        turns = [[m.role, m.content] for m in self.messages]
        return hashlib.sha256(json.dumps(turns, ensure_ascii=False).encode()).hexdigest()[:24]


def prepare(conversation: Conversation, spec: DatasetSpec) -> Prepared | str:
    """The turns to use, or the reason the conversation cannot be used (counted as skipped).

    When regenerating, each assistant turn that remains is a placeholder: the target answers there,
    given everything before it. Consecutive user turns are answered once (where the data answered
    them), a conversation that ends on a user turn gets an answer after it, and an assistant turn
    before any user turn (a greeting) is dropped: there is nothing to answer yet."""
    messages = _first_user_turns(list(conversation.messages), spec.max_turns)
    if spec.regenerate:
        messages = _answer_slots(messages)
    else:
        while messages and messages[-1].role == "user":
            messages.pop()  # a trailing question without its answer teaches the drafter nothing
    if not spec.regenerate and not any(m.role == "assistant" for m in messages):
        return "no_assistant_turn"
    if not any(m.role == "user" for m in messages):
        return "no_user_turn"
    if any(m.role == "user" and not m.content.strip() for m in messages):
        return "empty_user_turn"
    if spec.system_prompt is not None and not any(m.role == "system" for m in messages):
        messages.insert(0, Message(role="system", content=spec.system_prompt))
    return Prepared(id=conversation.id, source=conversation.source, messages=tuple(messages))


def _answer_slots(messages: list[Message]) -> list[Message]:
    slot = Message(role="assistant", content="")
    out: list[Message] = []
    for message in messages:
        if message.role != "assistant":
            out.append(message)
        elif any(m.role == "user" for m in out) and out[-1].role != "assistant":
            out.append(slot)
    if out and out[-1].role == "user":
        out.append(slot)
    return out


def _first_user_turns(messages: list[Message], max_turns: int | None) -> list[Message]:
    """Messages up to (not including) the user turn after the first `max_turns`."""
    if max_turns is None:
        return messages
    users = 0
    for i, message in enumerate(messages):
        if message.role == "user":
            users += 1
            if users > max_turns:
                return messages[:i]
    return messages


def record(prepared: Prepared, params_hash: str, messages: list[Message], **usage: Any) -> dict[str, Any]:
    """The journal/Parquet record of a finished conversation."""
    return {
        "id": prepared.id,
        "source": prepared.source,
        "params_hash": params_hash,
        "input_sha256": prepared.input_sha256,
        "messages": [{"role": m.role, "content": m.content, "reasoning": m.reasoning} for m in messages],
        "finish_reasons": usage.get("finish_reasons", []),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "cost": usage.get("cost"),
        "requests": usage.get("requests", 0),
        "turns_past_context": usage.get("turns_past_context", 0),
    }


@dataclass
class _Tally:
    """What the requests of one conversation cost."""

    finish_reasons: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0
    costs: list[float] = field(default_factory=list)

    def add(self, completion: Completion) -> None:
        self.finish_reasons.append(completion.finish_reason)
        self.prompt_tokens += completion.prompt_tokens
        self.completion_tokens += completion.completion_tokens
        self.requests += completion.attempts
        if completion.cost is not None:
            self.costs.append(completion.cost)


async def regenerate(
    client: ChatClient,
    prepared: Prepared,
    sampling: SamplingParams,
    params_hash: str,
    max_context_tokens: int | None = None,
) -> dict[str, Any]:
    """Ask the target for each assistant slot, in order, with the regenerated history so far. Once the
    conversation is `max_context_tokens` long (0 or None: no limit) the turns after are not asked: the
    record ends at the last answer, and `turns_past_context` counts the answers left out."""
    history: list[dict[str, str]] = []
    out: list[Message] = []
    tally = _Tally()
    past_context = 0
    for at, message in enumerate(prepared.messages):
        if message.role != "assistant":
            out.append(message)
            history.append({"role": message.role, "content": message.content})
            continue
        completion = visible(await client.complete(history, sampling))
        _check_answer(completion, prepared, len(tally.finish_reasons) + 1, sampling)
        out.append(Message(role="assistant", content=completion.content, reasoning=completion.reasoning))
        history.append({"role": "assistant", "content": completion.content})
        tally.add(completion)
        if (
            max_context_tokens
            and completion.prompt_tokens + completion.completion_tokens >= max_context_tokens
        ):
            past_context = sum(1 for m in prepared.messages[at + 1 :] if m.role == "assistant")
            break
    return record(
        prepared,
        params_hash,
        out,
        finish_reasons=tally.finish_reasons,
        prompt_tokens=tally.prompt_tokens,
        completion_tokens=tally.completion_tokens,
        cost=sum(tally.costs) if tally.costs else None,
        requests=tally.requests,
        turns_past_context=past_context,
    )


def visible(completion: Completion) -> Completion:
    """The completion with reasoning left inline in its content moved to its reasoning: the answer is
    what follows the block (none when it was cut off inside it). Reasoning the endpoint already returned
    apart wins; the inline copy is dropped, as the merge drops it."""
    split = split_answer(completion.content, None)
    if split.reasoning is None:
        return completion
    given = completion.reasoning if completion.reasoning and completion.reasoning.strip() else None
    return dataclasses.replace(
        completion, content=split.answer.lstrip(), reasoning=given if given is not None else split.reasoning
    )


def _check_answer(completion: Completion, prepared: Prepared, turn: int, sampling: SamplingParams) -> None:
    """Refuse an answer without visible text. Not retried: a model that spent max_tokens thinking
    does so again on a retry, at the same cost; the next run retries the conversation."""
    if completion.content.strip():
        return
    reasoning = completion.reasoning if completion.reasoning and completion.reasoning.strip() else None
    if reasoning is not None:
        what = f"only reasoning ({len(reasoning)} characters) and no final answer"
        fix = (
            f"raise sampling.max_tokens ({sampling.max_tokens}) or turn reasoning off in sampling.extra_body"
            if completion.finish_reason == "length"
            else "check the model's reasoning settings in sampling.extra_body"
        )
    else:
        what = "an empty answer" if not completion.content else "an answer of whitespace only"
        fix = "check the model and its chat template"
    raise EmptyAnswerError(
        f"conversation {prepared.id!r}, assistant turn {turn}: the endpoint returned {what} "
        f"(finish_reason={completion.finish_reason}); {fix}",
        completion.attempts,
        reasoning=reasoning,
        finish_reason=completion.finish_reason,
    )


def keep(prepared: Prepared, params_hash: str) -> dict[str, Any]:
    """A dataset that is not regenerated keeps the data's own assistant turns, in the same schema."""
    return record(prepared, params_hash, list(prepared.messages))
