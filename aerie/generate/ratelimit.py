"""Client-side rate limits: token buckets for requests per minute and tokens per minute.

A remote API (OpenRouter, a hosted provider) answers excess load with 429s; pacing requests to the
account's limits up front wastes no requests and keeps the retry budget for real failures.
"""

from __future__ import annotations

import asyncio
import time


class TokenBucket:
    """`per_minute` units refill continuously; a burst of at most `capacity` units passes at once.

    Waiters are served in arrival order (the lock is held while waiting), so a big request is not
    starved by a stream of small ones. A request larger than the capacity waits for a full bucket and
    then drives the level negative: the debt delays whoever comes next, which keeps the average right.
    """

    def __init__(self, per_minute: float, capacity: float | None = None) -> None:
        if per_minute <= 0:
            raise ValueError(f"rate must be positive, got {per_minute}")
        self.rate = per_minute / 60.0
        # One second of budget by default: smooth pacing rather than a minute's burst up front.
        self.capacity = capacity if capacity is not None else max(1.0, self.rate)
        self._level = self.capacity
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = time.monotonic()
        self._level = min(self.capacity, self._level + (now - self._stamp) * self.rate)
        self._stamp = now

    async def acquire(self, amount: float = 1.0) -> None:
        async with self._lock:
            need = min(amount, self.capacity)
            self._refill()
            while self._level < need:
                await asyncio.sleep((need - self._level) / self.rate)
                self._refill()
            self._level -= amount

    def correct(self, delta: float) -> None:
        """Charge (`delta` > 0) or refund (< 0) units once the real cost of a request is known."""
        self._refill()
        self._level = min(self.capacity, self._level - delta)


class RateLimiter:
    """Requests-per-minute and tokens-per-minute limits together; either may be off (None)."""

    def __init__(self, requests_per_minute: float | None, tokens_per_minute: float | None) -> None:
        self.requests = TokenBucket(requests_per_minute) if requests_per_minute else None
        self.tokens = TokenBucket(tokens_per_minute) if tokens_per_minute else None

    async def acquire(self, estimated_tokens: int) -> None:
        if self.requests is not None:
            await self.requests.acquire(1.0)
        if self.tokens is not None:
            await self.tokens.acquire(float(estimated_tokens))

    def settle(self, estimated_tokens: int, actual_tokens: int | None) -> None:
        """Replace a request's estimate with the tokens the endpoint reports it used."""
        if self.tokens is not None and actual_tokens is not None:
            self.tokens.correct(float(actual_tokens - estimated_tokens))
