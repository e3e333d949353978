"""An async, streaming serving benchmark for SGLang's `/generate` (and the reference server, which
speaks it).

Per concurrency level the same prompts (token ids, greedy, fixed `max_new_tokens`) are sent with at
most `concurrency` requests in flight, each with `"stream": true`: the server answers with server-sent
events, one `data: {...}` chunk per decoding step (`meta_info.completion_tokens` counts the tokens so
far), then `data: [DONE]`. Each chunk's arrival is timed on the client:

    output tokens/s   Σ completion tokens / wall time of the level
    latency           per request, send to the last chunk
    TTFT              per request, send to the first chunk that carries a token
    ITL               the gap between two chunks, shared by the tokens the later one carries (a
                      speculative step delivers several at once); p50 and p99 over every token of
                      the level after each request's first
    accept length     Σ completion_tokens / Σ spec_verify_ct from the last chunk's meta_info
                      (SpecForge's formula); None for a server without speculation

Steady state (`benchmark_async` with `seconds`): a level is a closed loop, one request after another
in each of `concurrency` slots, the slots' first requests staggered over one request's latency so the
batch holds requests at every stage of decoding. The timed window opens once every slot has finished
its first request (the ramp: prefills all at once) and closes once it has lasted `seconds` and every
slot has finished `requests_per_slot` requests inside it; the requests still in flight are cancelled
(the drain, when the batch empties, is never timed). Only tokens that arrived inside the window count.
The level is timed `repeats` times; its figures are the mean, with each run's tokens/s and the spread.

Requests that fail are errors, not slow samples: a level with any failure raises `EvaluationError`
naming the first one, since its throughput would not be comparable.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from aerie.errors import EvaluationError
from aerie.progress import ProgressFn, no_progress

TTFT_METHOD = "arrival of the first streamed chunk carrying a token (/generate with stream=true)"


@dataclass
class RequestRecord:
    index: int
    latency_s: float
    completion_tokens: int
    spec_verify_ct: int | None
    output_ids: list[int]
    ttft_s: float | None = None
    # Per token after the first: the gap before the chunk that brought it, divided by its tokens.
    itl_s: list[float] = field(default_factory=list)
    # Absolute clock of the request: when it was sent, when it ended, and (time, new tokens) per chunk.
    started: float = 0.0
    finished: float = 0.0
    arrivals: list[tuple[float, int]] = field(default_factory=list)


@dataclass
class LevelResult:
    server: str
    concurrency: int
    requests: int
    wall_s: float
    output_tokens: int
    output_tokens_per_s: float
    latency_p50_s: float
    latency_p90_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    accept_length: float | None
    # Steady state only: each timed run's output tokens/s, their (max - min) / mean, the timed window,
    # the trimmed ramp, and the fewest requests a slot finished inside a window.
    repeats: int = 1
    tokens_per_s_runs: list[float] = field(default_factory=list)
    spread: float | None = None
    window_s: float | None = None
    ramp_s: float | None = None
    requests_per_slot: int | None = None
    accept_length_runs: list[float | None] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 6)
            elif isinstance(value, list):
                out[key] = [round(v, 4) if isinstance(v, float) else v for v in value]
        return out


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1]


class _Stream:
    """One request's chunks as they arrive: tokens so far, their arrival gaps, the last meta_info."""

    def __init__(self, index: int, started: float) -> None:
        self.index, self.started = index, started
        self.output_ids: list[int] = []
        self.meta: dict[str, Any] = {}
        self.ttft_s: float | None = None
        self.itl_s: list[float] = []
        self.last_arrival = started
        self.arrivals: list[tuple[float, int]] = []

    def add(self, chunk: dict[str, Any], now: float) -> None:
        meta = chunk.get("meta_info") or {}
        ids = [int(t) for t in chunk.get("output_ids") or []]
        count = int(meta.get("completion_tokens", len(self.output_ids) + len(ids)))
        # SGLang sends the ids so far, or only the new ones (--stream-output): either adds up to count.
        self.output_ids = ids if len(ids) == count else self.output_ids + ids
        new = count - int(self.meta.get("completion_tokens", 0))
        self.meta = meta
        if new <= 0:
            return
        self.arrivals.append((now, new))
        if self.ttft_s is None:  # tokens beside the first in its chunk came with it
            self.ttft_s = now - self.started
            self.itl_s += [0.0] * (new - 1)
        else:
            self.itl_s += [(now - self.last_arrival) / new] * new
        self.last_arrival = now

    def record(self, latency_s: float) -> RequestRecord:
        verify = self.meta.get("spec_verify_ct")
        return RequestRecord(
            index=self.index,
            latency_s=latency_s,
            completion_tokens=int(self.meta.get("completion_tokens", len(self.output_ids))),
            spec_verify_ct=int(verify) if verify is not None else None,
            output_ids=self.output_ids,
            ttft_s=self.ttft_s,
            itl_s=self.itl_s,
            started=self.started,
            finished=self.started + latency_s,
            arrivals=self.arrivals,
        )


async def _generate(
    client: httpx.AsyncClient, prompt: list[int], max_new_tokens: int, index: int
) -> RequestRecord:
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
        "stream": True,
    }
    where = f"request {index} to {client.base_url}/generate"
    started = time.perf_counter()
    stream = _Stream(index, started)
    try:
        async with client.stream("POST", "/generate", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise EvaluationError(f"{where}: HTTP {response.status_code}: {text[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                stream.add(_chunk(data, where), time.perf_counter())
    except httpx.HTTPError as exc:
        raise EvaluationError(f"{where} failed: {exc!r}") from exc
    if stream.ttft_s is None:
        raise EvaluationError(f"{where}: the stream ended without a token")
    return stream.record(time.perf_counter() - started)


def _chunk(data: str, where: str) -> dict[str, Any]:
    try:
        chunk = json.loads(data)
    except ValueError as exc:
        raise EvaluationError(f"{where}: a streamed chunk is not JSON: {data[:200]!r}") from exc
    if not isinstance(chunk, dict):
        raise EvaluationError(f"{where}: a streamed chunk is not a JSON object: {data[:200]!r}")
    if "error" in chunk:
        raise EvaluationError(f"{where}: the server reported an error mid-stream: {chunk['error']}")
    return chunk


async def _level(
    client: httpx.AsyncClient, prompts: Sequence[list[int]], concurrency: int, max_new_tokens: int
) -> tuple[list[RequestRecord], float]:
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int, prompt: list[int]) -> RequestRecord:
        async with gate:
            return await _generate(client, prompt, max_new_tokens, index)

    started = time.perf_counter()
    records = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return list(records), time.perf_counter() - started


def summarize(server: str, concurrency: int, records: list[RequestRecord], wall_s: float) -> LevelResult:
    """One level's figures from its request records."""
    tokens = sum(r.completion_tokens for r in records)
    latencies = [r.latency_s for r in records]
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    itl = [gap for r in records for gap in r.itl_s]
    verify = [r.spec_verify_ct for r in records]
    accept = None
    if verify and all(v is not None for v in verify):
        total_verify = sum(v for v in verify if v is not None)
        accept = tokens / total_verify if total_verify else None
    return LevelResult(
        server=server,
        concurrency=concurrency,
        requests=len(records),
        wall_s=wall_s,
        output_tokens=tokens,
        output_tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        latency_p50_s=_percentile(latencies, 50),
        latency_p90_s=_percentile(latencies, 90),
        ttft_p50_s=_percentile(ttfts, 50) if ttfts else None,
        ttft_p90_s=_percentile(ttfts, 90) if ttfts else None,
        ttft_p99_s=_percentile(ttfts, 99) if ttfts else None,
        itl_p50_s=_percentile(itl, 50) if itl else None,
        itl_p99_s=_percentile(itl, 99) if itl else None,
        accept_length=accept,
    )


@dataclass
class SteadyRun:
    """One timed run of a level at steady state."""

    records: list[RequestRecord]  # every request that finished, window or not
    window: tuple[float, float]  # absolute clock: ramp over, stop
    ramp_s: float
    per_slot: int  # the fewest requests a slot finished inside the window

    @property
    def window_s(self) -> float:
        return self.window[1] - self.window[0]

    def tokens(self) -> int:
        """Tokens that arrived inside the window, whatever request brought them."""
        lo, hi = self.window
        return sum(n for r in self.records for t, n in r.arrivals if lo < t <= hi)

    def inside(self) -> list[RequestRecord]:
        lo, hi = self.window
        return [r for r in self.records if lo < r.finished <= hi]


async def _steady(
    client: httpx.AsyncClient,
    prompts: Sequence[list[int]],
    concurrency: int,
    max_new_tokens: int,
    seconds: float,
    requests_per_slot: int,
    stagger_s: float,
) -> SteadyRun:
    """One closed-loop run: each slot sends its next request as its last one ends, until the window has
    lasted `seconds` and each slot finished `requests_per_slot` requests in it; then the rest is cancelled."""
    started = time.perf_counter()
    records: list[RequestRecord] = []
    first_done: list[float | None] = [None] * concurrency
    in_window = [0] * concurrency
    sent = iter(range(1 << 62))
    done = asyncio.Event()
    window: list[float] = []

    def check(now: float) -> None:
        if any(t is None for t in first_done):
            return
        if not window:
            window.append(max(t for t in first_done if t is not None))
        if now - window[0] >= seconds and min(in_window) >= requests_per_slot:
            window.append(now)
            done.set()

    async def slot(i: int) -> None:
        await asyncio.sleep(i * stagger_s)
        while not done.is_set():
            index = next(sent)
            record = await _generate(client, prompts[index % len(prompts)], max_new_tokens, index)
            records.append(record)
            if first_done[i] is None:
                first_done[i] = record.finished
            elif window and record.finished > window[0]:
                in_window[i] += 1
            check(record.finished)

    tasks = [asyncio.create_task(slot(i)) for i in range(concurrency)]
    waiter = asyncio.create_task(done.wait())
    finished, _ = await asyncio.wait([*tasks, waiter], return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        if task in finished and task.exception() is not None:
            done.set()
    for task in tasks:
        task.cancel()  # the drain: requests in flight past the window are aborted, never timed
    results = await asyncio.gather(*tasks, return_exceptions=True)
    waiter.cancel()
    failure = next(
        (r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)),
        None,
    )
    if failure is not None:
        raise failure
    return SteadyRun(records, (window[0], window[1]), window[0] - started, min(in_window))


def steady_summary(server: str, concurrency: int, runs: list[SteadyRun]) -> LevelResult:
    """A level's figures from its timed runs: the mean tokens/s over the runs (tokens inside each window
    over its length), latency and ITL over the requests that finished inside the windows, acceptance
    from SGLang's per-request counts (Σ completion tokens / Σ spec_verify_ct), the spread."""
    inside = [r for run in runs for r in run.inside()]
    rates = [run.tokens() / run.window_s for run in runs]
    level = summarize(server, concurrency, inside, sum(run.window_s for run in runs))
    mean = statistics.fmean(rates)
    level.output_tokens = sum(run.tokens() for run in runs)
    level.output_tokens_per_s = mean
    level.repeats = len(runs)
    level.tokens_per_s_runs = rates
    level.spread = (max(rates) - min(rates)) / mean if mean else None
    level.window_s = statistics.fmean(run.window_s for run in runs)
    level.ramp_s = statistics.fmean(run.ramp_s for run in runs)
    level.requests_per_slot = min(run.per_slot for run in runs)
    level.accept_length_runs = [
        summarize(server, concurrency, run.inside(), 1.0).accept_length for run in runs
    ]
    return level


def first_outputs(records: list[RequestRecord], prompts: int) -> list[list[int]]:
    """Each prompt's greedy output, from the first request that carried it."""
    found: dict[int, list[int]] = {}
    for r in sorted(records, key=lambda r: r.index):
        found.setdefault(r.index % prompts, r.output_ids)
    return [found[i] for i in sorted(found)]


async def benchmark_async(
    base_url: str,
    server: str,
    prompts: Sequence[list[int]],
    concurrency: Sequence[int],
    max_new_tokens: int,
    *,
    warmup: int = 2,
    timeout_s: float = 600.0,
    progress: ProgressFn = no_progress,
    seconds: float | None = None,
    requests_per_slot: int = 1,
    repeats: int = 1,
) -> tuple[list[LevelResult], dict[int, list[list[int]]]]:
    """Every level in order; returns the results and, per level, each prompt's output ids (so the
    caller can check that two servers generated the same tokens). `seconds` set: each level at steady
    state (`_steady`), `repeats` times; unset: each prompt once per level."""
    if not prompts:
        raise EvaluationError("the benchmark needs at least one prompt")
    limits = httpx.Limits(
        max_connections=max(concurrency) + 4, max_keepalive_connections=max(concurrency) + 4
    )
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    results: list[LevelResult] = []
    outputs: dict[int, list[list[int]]] = {}
    async with httpx.AsyncClient(
        base_url=base_url, timeout=timeout, limits=limits, trust_env=False
    ) as client:
        if warmup:
            # One after another first, so that a request meets a cached prefix (the chat template's).
            progress(0.0, f"{server}: warm-up")
            await _level(client, list(prompts[:warmup]), 1, min(8, max_new_tokens))
        for i, level in enumerate(concurrency):
            warm: list[RequestRecord] = []
            if warmup:
                # The level's own workload once, untimed: the timed pass then meets the batch shapes and
                # the prefix cache this pass made (greedy outputs are the same), so a server compiling
                # kernels per shape on first use (SGLang's Triton backend) compiles them here.
                progress(i / len(concurrency), f"{server}: warm-up at concurrency {level}")
                warm, _ = await _level(client, prompts, level, max_new_tokens)
            if seconds is not None:
                # Stagger the slots' first requests over one request's latency (the warm pass's median).
                latency = _percentile([r.latency_s for r in warm], 50) if warm else 0.0
                runs = []
                for rep in range(repeats):
                    progress(
                        i / len(concurrency), f"{server}: concurrency {level}, timed run {rep + 1}/{repeats}"
                    )
                    runs.append(
                        await _steady(
                            client,
                            prompts,
                            level,
                            max_new_tokens,
                            seconds,
                            requests_per_slot,
                            latency / level,
                        )
                    )
                results.append(steady_summary(server, level, runs))
                outputs[level] = first_outputs([r for run in runs for r in run.records], len(prompts))
                progress(
                    (i + 1) / len(concurrency),
                    f"{server}: {results[-1].output_tokens_per_s:.1f} tok/s at {level} "
                    f"(spread {results[-1].spread or 0:.1%})",
                )
                continue
            progress(i / len(concurrency), f"{server}: {len(prompts)} requests at concurrency {level}")
            records, wall = await _level(client, prompts, level, max_new_tokens)
            results.append(summarize(server, level, records, wall))
            outputs[level] = [r.output_ids for r in sorted(records, key=lambda r: r.index)]
            progress(
                (i + 1) / len(concurrency),
                f"{server}: {results[-1].output_tokens_per_s:.1f} tok/s at {level}",
            )
    return results, outputs


def benchmark(
    base_url: str,
    server: str,
    prompts: Sequence[list[int]],
    concurrency: Sequence[int],
    max_new_tokens: int,
    **kwargs: Any,
) -> tuple[list[LevelResult], dict[int, list[list[int]]]]:
    """`benchmark_async` from synchronous code (a stage, a flow task, a script)."""
    return asyncio.run(benchmark_async(base_url, server, prompts, concurrency, max_new_tokens, **kwargs))


def engine_accept_length(base_url: str, timeout_s: float = 10.0) -> float | None:
    """SGLang's own running accept length (`/server_info` → `internal_states[0].avg_spec_accept_length`:
    accepted tokens over verify rounds since the server started, counted by its scheduler); None where the
    server does not report one (the reference server, a server without speculation)."""
    try:
        with httpx.Client(base_url=base_url, timeout=timeout_s, trust_env=False) as client:
            response = client.get("/server_info")
        states = response.json().get("internal_states") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(states, list) or not states or not isinstance(states[0], dict):
        return None
    value = states[0].get("avg_spec_accept_length")
    return float(value) if isinstance(value, int | float) else None
