"""One extraction server and its slice of the corpus: launch, pump batches, pack shards, restart.

Batches go out `requests_in_flight` at a time but are committed strictly in row order, so the shard
writer sees the slice's samples in corpus order whatever order the replies come in. Committing hands
the samples to a `ShardCommitter` (encoding on `commit_workers` threads, shards written behind), so
the pump waits only when that pipeline is full. If the server dies (connection refused/reset, a 5xx,
a dump that never appears) the uncommitted batches are simply sent again to a fresh server: the
committer keeps everything committed so far, and the rids name the row, so a retry overwrites a stale
dump instead of duplicating a sample. When the slice fails for good, what was committed is drained
into shards first (uploaded, so a re-run resumes after them), unless the commit path itself failed.
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

from aerie.errors import ExtractionError
from aerie.extract.client import ExtractionClient, ServerUnavailable, make_batches
from aerie.extract.commit import ShardCommitter
from aerie.extract.config import ExtractConfig
from aerie.extract.corpus_rows import SplitFiles
from aerie.extract.phases import PhaseTotals, RequestTiming
from aerie.extract.resume import ClosedShard, ProgressFile
from aerie.extract.uploads import Uploader
from aerie.serving import ModelServer
from aerie.serving.restarts import ServerSlot
from aerie.shards.format import HiddenSample, ShardInfo
from aerie.shards.writer import ShardWriter

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
    # Of pump_seconds, the time the pump waited on the commit path (handing samples over while it was
    # full, and its final drain; the rest waits on the server and the dump reads): near 1 of
    # pump_seconds means this client, not the server, sets the pace.
    commit_seconds: float = 0.0
    # Where pump_seconds went, client and server side (`aerie.extract.phases`).
    phases: PhaseTotals = field(default_factory=PhaseTotals)
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
        vocab_size: int,
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
        self.vocab_size = vocab_size
        self.progress_file = progress_file
        self.uploader = uploader
        self.start_server = start_server
        self.meter = meter
        self.stop_event = stop
        self.quantize_device = quantize_device
        self.result = SliceResult(slice=k)
        self._at = ("", 0)  # where the slice is, for the message once restarts are used up
        self.slot = ServerSlot(
            lambda attempt: start_server(k, attempt),
            name=f"slice {k}",
            max_restarts=cfg.max_restarts,
            exhausted=self._exhausted,
            say=lambda message: log.warning("%s, at %s row %d", message, *self._at),
        )

    # -- per split --------------------------------------------------------------------------------

    def run(self) -> SliceResult:
        try:
            for split in self.cfg.splits:
                self._run_split(split)
        finally:
            self.slot.stop()
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
            vocab_size=self.vocab_size,
            prefix=f"shard-s{self.k}",
            first_index=index,
            quantize_device=self.quantize_device,
            direct_io=self.cfg.direct_io,
            aux_layers=self.cfg.aux_layers,
        )
        committer = ShardCommitter(
            writer,
            first_row=row,
            workers=self.cfg.resolved_commit_workers(),
            # Samples map their dumps (deleted once mapped): until their shard is written, the buffer
            # holds dump pages, which the preflight's count of dumps in flight includes.
            max_pending_tokens=self.cfg.resolved_commit_buffer_tokens(),
            on_closed=lambda info, first, end: self._closed(info, split, first, end),
            on_appended=self._appended,
        )
        try:
            self._pump_split(split, hi, committer)
            began = time.monotonic()
            uploads_before = self._uploads_now()
            committer.finish()
            finished = time.monotonic() - began
            self._uploads_since(uploads_before)
            self.result.pump_seconds += finished
            self.result.commit_seconds += finished
            self.result.phases.committed(finished)
        except Exception:
            if not committer.failed:
                self._drain_quietly(committer, split)
            raise
        finally:
            committer.close()
            # The committer's threads are done: its busy times are final (the whole split's).
            self.result.phases.commit_busy(committer.busy(), committer.counts())

    def _pump_split(self, split: str, hi: int, committer: ShardCommitter) -> None:
        while committer.next_row < hi:
            if self.stop_event.is_set():
                raise ExtractionError(f"slice {self.k}: stopped because another slice failed")
            self._at = (split, committer.next_row)
            server, generation = self.slot.get()
            began = time.monotonic()
            uploads_before = self._uploads_now()
            try:
                try:
                    asyncio.run(self._pump(server, split, hi, committer))
                finally:  # extracting only: stopping a failed server is not part of it
                    self.result.pump_seconds += time.monotonic() - began
                    self._uploads_since(uploads_before)
            except ServerUnavailable as exc:
                self._at = (split, committer.next_row)
                self.slot.failed(generation, exc)
            finally:
                self.result.restarts, self.result.errors = self.slot.restarts, self.slot.errors

    def _uploads_now(self) -> tuple[dict[str, float], dict[str, int]]:
        return self.uploader.busy(), self.uploader.counts()

    def _uploads_since(self, before: tuple[dict[str, float], dict[str, int]]) -> None:
        """Add the uploader's busy time since `before` (one of this slice's pump windows; the uploader
        is the stage's, so this includes the uploads of this host's other servers)."""
        seconds, counts = self._uploads_now()
        self.result.phases.commit_busy(
            {k: v - before[0].get(k, 0.0) for k, v in seconds.items()},
            {k: n - before[1].get(k, 0) for k, n in counts.items()},
        )

    def _drain_quietly(self, committer: ShardCommitter, split: str) -> None:
        """The slice is failing: get what it committed into shards (and uploads), so the re-run
        resumes after them, without hiding the failure that is on its way up."""
        try:
            committer.drain()
        except Exception:
            log.exception("slice %d (%s): draining the commit path while failing failed too", self.k, split)

    # -- server life --------------------------------------------------------------------------------

    def _exhausted(self, why: str) -> ExtractionError:
        split, row = self._at
        return ExtractionError(
            f"slice {self.k} ({split} row {row}): the server failed and max_restarts="
            f"{self.cfg.max_restarts} is used up; committed shards are kept and a re-run resumes.\n{why}"
        )

    # -- the pump -----------------------------------------------------------------------------------

    async def _pump(self, server: ModelServer, split: str, hi: int, committer: ShardCommitter) -> None:
        assert server.spec.dump_dir is not None
        client = ExtractionClient(
            server.url,
            server.spec.dump_dir,
            request_timeout_s=self.cfg.request_timeout_s,
            dump_timeout_s=self.cfg.dump_timeout_s,
        )
        rows = self.splits[split].iter_rows(committer.next_row, hi)
        batches = make_batches(rows, self.cfg.batch_tokens, rid_prefix=f"{split}")
        in_flight: deque[tuple[asyncio.Task[list[HiddenSample]], RequestTiming]] = deque()
        handing: list[asyncio.Future[None]] = []  # the batch being handed to the commit path (0 or 1)
        server_before = server_after = None
        try:
            server_before = await client.server_phases()
            for batch in batches:
                if self.stop_event.is_set():
                    raise ExtractionError(f"slice {self.k}: stopped because another slice failed")
                timing = RequestTiming()
                in_flight.append((asyncio.create_task(client.extract(batch, timing)), timing))
                if len(in_flight) >= self.cfg.requests_in_flight:
                    await self._commit_next(in_flight, committer, handing)
            while in_flight:
                await self._commit_next(in_flight, committer, handing)
            began = time.monotonic()
            await self._handed_over(handing)
            self.result.phases.committed(time.monotonic() - began)
            server_after = await client.server_phases()
        finally:
            self.result.phases.server_window(server_before, server_after)
            for task, _ in in_flight:
                task.cancel()
            # A hand-over still running finishes (it cannot be interrupted mid-sample): a restart
            # resumes from `committer.next_row`, which must be final by then.
            await asyncio.gather(*(task for task, _ in in_flight), *handing, return_exceptions=True)
            await client.aclose()

    async def _commit_next(
        self,
        in_flight: deque[tuple[asyncio.Task[list[HiddenSample]], RequestTiming]],
        committer: ShardCommitter,
        handing: list[asyncio.Future[None]],
    ) -> None:
        """Wait for the oldest request, then start handing its samples to the commit path once the
        previous batch is handed over (row order); the waits go to the phases. The pump does not wait
        for the hand-over itself: it starts its next request meanwhile (on an H200 the hand-over, a
        thread blocked on the commit path or the GIL, was a third of the pump's wall)."""
        task, timing = in_flight.popleft()
        began = time.monotonic()
        samples = await task
        replied = time.monotonic()
        self.result.phases.waited_on(timing, began, replied)
        await self._handed_over(handing)
        self.result.phases.committed(time.monotonic() - replied)
        handing.append(asyncio.ensure_future(asyncio.to_thread(self._commit, samples, committer)))

    @staticmethod
    async def _handed_over(handing: list[asyncio.Future[None]]) -> None:
        """Wait for the batch being handed over, if any; raises what its hand-over raised."""
        if handing:
            await handing.pop()

    def _commit(self, samples: list[HiddenSample], committer: ShardCommitter) -> None:
        """Hand a batch to the commit path (in a thread: `submit` blocks while the path is full, and
        the event loop keeps the requests in flight going meanwhile)."""
        began = time.monotonic()
        committer.submit_many(samples)
        self.result.commit_seconds += time.monotonic() - began

    def _appended(self, tokens: int) -> None:
        """A sample is in its shard (the commit path's append thread): count it as extracted."""
        self.result.tokens += tokens
        self.meter.add(tokens)

    def _closed(self, info: ShardInfo, split: str, first_row: int, end_row: int) -> None:
        """A shard is written (the commit path's write thread, in shard order): upload it."""
        index = int(info.name.rsplit("-", 1)[1].split(".")[0])
        shard = ClosedShard(
            split=split,
            slice=self.k,
            index=index,
            name=info.name,
            path=f"shards/{split}/{info.name}",
            first_row=first_row,
            end_row=end_row,
            samples=info.samples,
            tokens=info.tokens,
            bytes=info.bytes,
            sha256=info.sha256,
        )
        self.uploader.submit(info, shard)
        self.result.shards.append(shard)
