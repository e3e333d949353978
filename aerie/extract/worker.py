"""One extraction server and its slice of the corpus: launch, pump batches, pack shards, restart.

Batches go out `requests_in_flight` at a time but are committed strictly in row order, so the shard
writer sees the slice's samples in corpus order whatever order the replies come in. If the server
dies (connection refused/reset, a 5xx, a dump that never appears) the uncommitted batches are simply
sent again to a fresh server: the writer keeps everything committed so far, and the rids name the row,
so a retry overwrites a stale dump instead of duplicating a sample.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aerie.errors import ExtractionError, ServerError
from aerie.extract.client import ExtractionClient, ServerUnavailable, make_batches
from aerie.extract.config import ExtractConfig
from aerie.extract.corpus_rows import SplitFiles
from aerie.extract.resume import ClosedShard, ProgressFile
from aerie.extract.shards import HiddenSample, ShardInfo, ShardWriter
from aerie.extract.uploads import Uploader
from aerie.serving import ModelServer

log = logging.getLogger(__name__)

ServerFactory = Callable[[int, int], ModelServer]  # (slice, attempt) -> a started server


@dataclass
class SliceResult:
    slice: int
    shards: list[ClosedShard] = field(default_factory=list)
    tokens: int = 0
    restarts: int = 0
    resumed_rows: int = 0
    pump_seconds: float = 0.0  # time spent extracting, without server starts and canaries
    # Of pump_seconds, the time spent adding samples to shards (the rest waits on the server and the
    # dump reads): near 1 of pump_seconds means this client, not the server, sets the pace.
    commit_seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


class TokenMeter:
    """Tokens committed across all slices, for progress (tokens/s, ETA)."""

    def __init__(self, total: int, done: int, report: Callable[[float, str], None]) -> None:
        self.total = max(total, 1)
        self.done = done
        self.start_done = done
        self.began = time.monotonic()
        self._report = report
        self._lock = threading.Lock()
        self._last = 0.0

    def add(self, tokens: int, force: bool = False) -> None:
        with self._lock:
            self.done += tokens
            now = time.monotonic()
            if not force and now - self._last < 0.2:
                return
            self._last = now
            self._report(self.done / self.total, self.message())

    def rate(self) -> float:
        elapsed = time.monotonic() - self.began
        return (self.done - self.start_done) / elapsed if elapsed > 0 else 0.0

    def message(self) -> str:
        rate = self.rate()
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_s = f"{eta / 60:.1f} min" if eta != float("inf") else "?"
        return f"{self.done:,}/{self.total:,} tokens, {rate:,.0f} tok/s, ETA {eta_s}"


class SliceWorker:
    """Extracts slice `k` of every split through its own server."""

    def __init__(
        self,
        k: int,
        *,
        cfg: ExtractConfig,
        splits: dict[str, SplitFiles],
        bounds: dict[str, tuple[int, int]],
        prefix: str,
        local_dir: Path,
        hidden_size: int,
        progress_file: ProgressFile,
        uploader: Uploader,
        start_server: ServerFactory,
        meter: TokenMeter,
        stop: threading.Event,
        quantize_device: str = "cpu",
    ) -> None:
        self.k = k
        self.cfg = cfg
        self.splits = splits
        self.bounds = bounds
        self.prefix = prefix
        self.local_dir = local_dir
        self.hidden_size = hidden_size
        self.progress_file = progress_file
        self.uploader = uploader
        self.start_server = start_server
        self.meter = meter
        self.stop_event = stop
        self.quantize_device = quantize_device
        self.result = SliceResult(slice=k)
        self._server: ModelServer | None = None
        self._attempt = 0

    # -- per split --------------------------------------------------------------------------------

    def run(self) -> SliceResult:
        try:
            for split in self.cfg.splits:
                self._run_split(split)
        finally:
            if self._server is not None:
                self._server.stop()
                self._server = None
        return self.result

    def _run_split(self, split: str) -> None:
        lo, hi = self.bounds[split]
        row, index, kept = self.progress_file.resume_point(self.prefix, split, self.k, lo)
        self.result.shards.extend(kept)
        self.result.resumed_rows += row - lo
        if row >= hi:
            return
        writer = ShardWriter(
            self.local_dir / split,
            storage=self.cfg.storage_dtype,
            shard_bytes=self.cfg.shard_bytes,
            hidden_size=self.hidden_size,
            prefix=f"shard-s{self.k}",
            first_index=index,
            quantize_device=self.quantize_device,
        )
        state = _SplitState(split=split, next_row=row, shard_first=row)
        while state.next_row < hi:
            if self.stop_event.is_set():
                raise ExtractionError(f"slice {self.k}: stopped because another slice failed")
            server = self._ensure_server()
            began = time.monotonic()
            try:
                asyncio.run(self._pump(server, split, hi, writer, state))
            except ServerUnavailable as exc:
                self._on_server_failure(server, exc, split, state.next_row)
            finally:
                self.result.pump_seconds += time.monotonic() - began
        began = time.monotonic()
        info = writer.close()
        if info is not None:
            self._closed(info, split, state, end_row=hi)
        self.result.pump_seconds += time.monotonic() - began

    # -- server life --------------------------------------------------------------------------------

    def _ensure_server(self) -> ModelServer:
        if self._server is None:
            self._server = self.start_server(self.k, self._attempt)
            self._attempt += 1
        return self._server

    def _on_server_failure(self, server: ModelServer, exc: ServerUnavailable, split: str, row: int) -> None:
        try:
            server.check_alive()
            why = f"server s{self.k} is alive but failed: {exc}"
        except ServerError as dead:
            why = str(dead)
        self.result.errors.append(why.splitlines()[0])
        server.stop()
        self._server = None
        if self.result.restarts >= self.cfg.max_restarts:
            raise ExtractionError(
                f"slice {self.k} ({split} row {row}): the server failed and max_restarts="
                f"{self.cfg.max_restarts} is used up; committed shards are kept and a re-run resumes.\n{why}"
            ) from exc
        self.result.restarts += 1
        log.warning(
            "slice %d: restarting the server (%d/%d) at %s row %d: %s",
            self.k,
            self.result.restarts,
            self.cfg.max_restarts,
            split,
            row,
            why.splitlines()[0],
        )

    # -- the pump -----------------------------------------------------------------------------------

    async def _pump(
        self, server: ModelServer, split: str, hi: int, writer: ShardWriter, state: _SplitState
    ) -> None:
        assert server.spec.dump_dir is not None
        client = ExtractionClient(
            server.url,
            server.spec.dump_dir,
            request_timeout_s=self.cfg.request_timeout_s,
            dump_timeout_s=self.cfg.dump_timeout_s,
        )
        rows = self.splits[split].iter_rows(state.next_row, hi)
        batches = make_batches(rows, self.cfg.batch_tokens, rid_prefix=f"{split}")
        in_flight: deque[asyncio.Task[list[HiddenSample]]] = deque()
        try:
            for batch in batches:
                if self.stop_event.is_set():
                    raise ExtractionError(f"slice {self.k}: stopped because another slice failed")
                in_flight.append(asyncio.create_task(client.extract(batch)))
                if len(in_flight) >= self.cfg.requests_in_flight:
                    samples = await in_flight.popleft()
                    await asyncio.to_thread(self._commit, samples, writer, state)
            while in_flight:
                samples = await in_flight.popleft()
                await asyncio.to_thread(self._commit, samples, writer, state)
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
            await client.aclose()

    def _commit(self, samples: list[HiddenSample], writer: ShardWriter, state: _SplitState) -> None:
        began = time.monotonic()
        tokens = 0
        for sample in samples:
            row = state.next_row
            info = writer.add(sample)
            if info is not None:
                self._closed(info, state.split, state, end_row=row)
            state.next_row = row + 1
            tokens += sample.tokens
        self.result.tokens += tokens
        self.meter.add(tokens)
        self.result.commit_seconds += time.monotonic() - began

    def _closed(self, info: ShardInfo, split: str, state: _SplitState, *, end_row: int) -> None:
        index = int(info.name.rsplit("-", 1)[1].split(".")[0])
        shard = ClosedShard(
            split=split,
            slice=self.k,
            index=index,
            name=info.name,
            path=f"shards/{split}/{info.name}",
            first_row=state.shard_first,
            end_row=end_row,
            samples=info.samples,
            tokens=info.tokens,
            bytes=info.bytes,
            sha256=info.sha256,
        )
        if shard.end_row - shard.first_row != shard.samples:
            raise ExtractionError(
                f"internal: shard {info.name} holds {info.samples} samples but rows {shard.first_row}..{end_row}"
            )
        state.shard_first = end_row
        self.uploader.submit(info, shard)
        self.result.shards.append(shard)


@dataclass
class _SplitState:
    split: str
    next_row: int
    shard_first: int
