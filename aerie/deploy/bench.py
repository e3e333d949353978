"""An async serving benchmark for SGLang's `/generate` (and the reference server, which speaks it).

Per concurrency level the same prompts (token ids, greedy, fixed `max_new_tokens`) are sent with at
most `concurrency` requests in flight:

    output tokens/s   Σ completion tokens / wall time of the level
    latency           per request, send to full reply
    TTFT              neither server streams `/generate` here, so time to first token is measured as the
                      latency of the same prompt with max_new_tokens=1, at the same concurrency
    ITL               per request (latency - TTFT) / (completion tokens - 1)
    accept length     Σ completion_tokens / Σ spec_verify_ct from meta_info (SpecForge's formula);
                      None for a server without speculation

Requests that fail are errors, not slow samples: a level with any failure raises `EvaluationError`
naming the first one, since its throughput would not be comparable.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from aerie.errors import EvaluationError
from aerie.progress import ProgressFn, no_progress

TTFT_METHOD = (
    "latency of a max_new_tokens=1 request for the same prompt at the same concurrency (no streaming)"
)


@dataclass
class RequestRecord:
    index: int
    latency_s: float
    completion_tokens: int
    spec_verify_ct: int | None
    output_ids: list[int]


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
    itl_p50_s: float | None
    accept_length: float | None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 6)
        return out


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1]


async def _generate(
    client: httpx.AsyncClient, prompt: list[int], max_new_tokens: int, index: int
) -> RequestRecord:
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}}
    started = time.perf_counter()
    try:
        response = await client.post("/generate", json=body)
    except httpx.HTTPError as exc:
        raise EvaluationError(f"request {index} to {client.base_url}/generate failed: {exc!r}") from exc
    latency = time.perf_counter() - started
    if response.status_code != 200:
        raise EvaluationError(
            f"request {index} to {client.base_url}/generate: HTTP {response.status_code}: {response.text[:300]}"
        )
    reply = response.json()
    item = reply[0] if isinstance(reply, list) else reply
    meta = item.get("meta_info", {})
    ids = item.get("output_ids") or []
    verify = meta.get("spec_verify_ct")
    return RequestRecord(
        index=index,
        latency_s=latency,
        completion_tokens=int(meta.get("completion_tokens", len(ids))),
        spec_verify_ct=int(verify) if verify is not None else None,
        output_ids=[int(t) for t in ids],
    )


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


def summarize(
    server: str,
    concurrency: int,
    records: list[RequestRecord],
    wall_s: float,
    ttft: dict[int, float] | None,
) -> LevelResult:
    """One level's figures from its request records (and the TTFT probes by prompt index)."""
    tokens = sum(r.completion_tokens for r in records)
    latencies = [r.latency_s for r in records]
    itl = [
        (r.latency_s - ttft[r.index]) / (r.completion_tokens - 1)
        for r in records
        if ttft is not None and r.index in ttft and r.completion_tokens > 1
    ]
    verify = [r.spec_verify_ct for r in records]
    accept = None
    if verify and all(v is not None for v in verify):
        total_verify = sum(v for v in verify if v is not None)
        accept = tokens / total_verify if total_verify else None
    ttfts = list(ttft.values()) if ttft else []
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
        itl_p50_s=_percentile(itl, 50) if itl else None,
        accept_length=accept,
    )


async def benchmark_async(
    base_url: str,
    server: str,
    prompts: Sequence[list[int]],
    concurrency: Sequence[int],
    max_new_tokens: int,
    *,
    warmup: int = 2,
    timeout_s: float = 600.0,
    measure_ttft: bool = True,
    progress: ProgressFn = no_progress,
) -> tuple[list[LevelResult], dict[int, list[list[int]]]]:
    """Every level in order; returns the results and, per level, each prompt's output ids (so the
    caller can check that two servers generated the same tokens)."""
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
            progress(0.0, f"{server}: warm-up")
            await _level(client, list(prompts[:warmup]), warmup, min(8, max_new_tokens))
        for i, level in enumerate(concurrency):
            ttft: dict[int, float] | None = None
            if measure_ttft:
                progress(i / len(concurrency), f"{server}: TTFT probes at concurrency {level}")
                probes, _ = await _level(client, prompts, level, 1)
                ttft = {r.index: r.latency_s for r in probes}
            progress(
                (i + 0.5) / len(concurrency), f"{server}: {len(prompts)} requests at concurrency {level}"
            )
            records, wall = await _level(client, prompts, level, max_new_tokens)
            results.append(summarize(server, level, records, wall, ttft))
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
