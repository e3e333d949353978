"""The core of one dataset's generation, independent of where conversations come from or go to.

`generate_conversations` takes any iterable of `Conversation`s, skips what the journal already holds,
runs the rest through the client with bounded concurrency and appends each finished conversation to
the journal the moment it completes. Failures are counted against a budget: once more conversations
have failed than the dataset may lose, the outcome is decided and the run stops early instead of
spending hours (and money) on a dataset that will be rejected anyway.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from aerie.conversation import Conversation
from aerie.generate.client import ChatClient, RequestFailedError
from aerie.generate.config import DatasetSpec
from aerie.generate.journal import Journal
from aerie.generate.turns import EmptyAnswerError, Prepared, keep, prepare, regenerate
from aerie.progress import ProgressFn, no_progress


@dataclass
class Outcome:
    """What one run did. Token and request figures count this run's work only."""

    requested_ids: list[str] = field(default_factory=list)  # usable conversations, input order
    inputs: dict[str, str] = field(default_factory=dict)  # id -> digest of what it is generated from
    done_before: int = 0  # reused: the journal holds the same id generated from the same input
    changed: int = 0  # the journal holds the id, generated from another input: generated again
    done_now: int = 0
    failures: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: Counter[str] = field(default_factory=Counter)
    allowed_failures: int = 0
    aborted: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0
    requests: int = 0
    seconds: float = 0.0

    @property
    def requested(self) -> int:
        return len(self.requested_ids)

    @property
    def finished(self) -> int:
        return self.done_before + self.done_now

    def errors_by_kind(self) -> dict[str, int]:
        return dict(Counter(f["kind"] for f in self.failures.values()))


class _BudgetExceeded(Exception):
    """More conversations failed than the dataset may lose: stop now (internal)."""


def select(
    conversations: Iterable[Conversation], spec: DatasetSpec, done: set[tuple[str, str]], outcome: Outcome
) -> list[Prepared]:
    """The conversations still to generate, in input order; fills the outcome's counts. A conversation
    resumes only from a record of the same id and the same input: one whose turns changed since (a
    source fixed in place) is generated again, never answered with what its old text gave."""
    done_ids = {conversation_id for conversation_id, _ in done}
    seen: set[str] = set()
    pending: list[Prepared] = []
    for conversation in conversations:
        if conversation.id in seen:
            outcome.skipped["duplicate_id"] += 1  # resume keys on the id: a second copy would be ambiguous
            continue
        seen.add(conversation.id)
        prepared = prepare(conversation, spec)
        if isinstance(prepared, str):
            outcome.skipped[prepared] += 1
            continue
        outcome.requested_ids.append(prepared.id)
        outcome.inputs[prepared.id] = prepared.input_sha256
        if (prepared.id, prepared.input_sha256) in done:
            outcome.done_before += 1
            continue
        if prepared.id in done_ids:
            outcome.changed += 1
        pending.append(prepared)
    return pending


async def generate_conversations(
    conversations: Iterable[Conversation],
    spec: DatasetSpec,
    journal: Journal,
    *,
    client: ChatClient | None,
    concurrency: int,
    max_failure_fraction: float,
    progress: ProgressFn = no_progress,
    progress_interval_s: float = 1.0,
    on_tick: Callable[[], None] | None = None,
    tick_interval_s: float = 60.0,
    outcome: Outcome | None = None,
) -> Outcome:
    """Generate every conversation the journal does not hold yet. `client` may be None only for a
    dataset that keeps its own assistant turns. Raises `EndpointAuthError`/`EndpointRequestError`.
    `outcome`, when given, is filled as the run goes (a caller can say what a cancelled run kept)."""
    outcome = Outcome() if outcome is None else outcome
    pending = select(conversations, spec, journal.done(), outcome)
    outcome.allowed_failures = math.floor(max_failure_fraction * outcome.requested)
    started = time.monotonic()
    ticker = asyncio.create_task(
        _tick(outcome, started, journal, progress, progress_interval_s, on_tick, tick_interval_s)
    )
    try:
        if not spec.regenerate:
            for prepared in pending:
                journal.append(keep(prepared, journal.params_hash))
                outcome.done_now += 1
        else:
            if client is None:
                raise ValueError("a regenerated dataset needs a client")
            await _run_workers(pending, spec, journal, client, concurrency, outcome)
    finally:
        ticker.cancel()
        outcome.seconds = time.monotonic() - started
        journal.record_seconds(outcome.seconds)
        if client is not None:
            outcome.requests = client.stats.requests
    return outcome


async def _run_workers(
    pending: list[Prepared],
    spec: DatasetSpec,
    journal: Journal,
    client: ChatClient,
    concurrency: int,
    outcome: Outcome,
) -> None:
    queue = iter(longest_first(pending))  # shared by the workers; next() never awaits, so no lock is needed

    async def worker() -> None:
        for prepared in queue:
            try:
                rec = await regenerate(
                    client, prepared, spec.sampling, journal.params_hash, spec.max_context_tokens
                )
            except RequestFailedError as exc:
                outcome.failures[prepared.id] = failure_record(prepared, exc)
                journal.append_error(outcome.failures[prepared.id])
                if len(outcome.failures) > outcome.allowed_failures:
                    raise _BudgetExceeded() from exc
                continue
            journal.append(rec)
            outcome.done_now += 1
            outcome.prompt_tokens += rec["prompt_tokens"]
            outcome.completion_tokens += rec["completion_tokens"]
            outcome.cost += rec["cost"] or 0.0

    workers = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(pending)))]
    if not workers:
        return
    try:
        done, running = await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        # Ctrl-C: the requests in flight are abandoned now (their conversations are asked again on
        # resume), before the client closes under them.
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        raise
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    errors = [task.exception() for task in done]  # retrieve every one: none goes unreported
    fatal = [exc for exc in errors if exc is not None and not isinstance(exc, _BudgetExceeded)]
    if fatal:
        raise fatal[0]
    outcome.aborted = any(isinstance(exc, _BudgetExceeded) for exc in errors)


def longest_first(pending: list[Prepared]) -> list[Prepared]:
    """The conversations by the text they send, longest first. A batching server decodes its running
    requests over the longest one's context: long conversations started together, while the batch is
    full, keep the rest of the run at short contexts instead of stretching a step here and there all
    along (and no long one is left to run alone at the end). The output keeps the input order."""
    return sorted(pending, key=lambda p: -sum(len(m.content) for m in p.messages))


def failure_record(prepared: Prepared, exc: RequestFailedError) -> dict[str, Any]:
    """The errors.jsonl record of a conversation that failed; an empty answer keeps its reasoning
    (and why it stopped) in fields of their own, never as an answer."""
    record: dict[str, Any] = {
        "id": prepared.id,
        "kind": exc.kind,
        "message": str(exc),
        "attempts": exc.attempts,
    }
    if isinstance(exc, EmptyAnswerError):
        record["finish_reason"] = exc.finish_reason
        record["reasoning"] = exc.reasoning
    return record


async def _tick(
    outcome: Outcome,
    started: float,
    journal: Journal,
    progress: ProgressFn,
    interval_s: float,
    on_tick: Callable[[], None] | None,
    tick_interval_s: float,
) -> None:
    last_tick = time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        progress(fraction(outcome), progress_message(outcome, time.monotonic() - started))
        journal.record_seconds(time.monotonic() - started)
        if on_tick is not None and time.monotonic() - last_tick >= tick_interval_s:
            last_tick = time.monotonic()
            await asyncio.to_thread(on_tick)


def fraction(outcome: Outcome) -> float:
    if outcome.requested == 0:
        return 1.0
    return (outcome.finished + len(outcome.failures)) / outcome.requested


def progress_message(outcome: Outcome, seconds: float) -> str:
    rate = outcome.done_now / seconds if seconds > 0 else 0.0
    return (
        f"{outcome.finished}/{outcome.requested} conversations, {len(outcome.failures)} failed, "
        f"{rate:.1f} conv/s"
    )
