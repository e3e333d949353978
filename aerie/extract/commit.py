"""The commit path of one server's slice: samples in row order in, shards out, on several cores.

`ShardWriter.add` does everything in one thread: encode (fp8 quantization, a few passes over every
value), append, and every ~1 GB write and hash of a closed shard. On a GPU host that one thread set
the pace of the whole extraction (it was busy 84% of the time). `ShardCommitter` splits the work:

    submit_many (the pump's hand-over, a request's samples at once)
        --> encode pool (`workers` threads, rows of a sample in parallel; skipped where encoding is
            only slicing: fp8 from the server, bf16 into bf16)
        --> append (one thread, strict row order) --> write (one thread: a shard's bytes)
        --> sync (one thread: fsync and rename) --> on_closed(info, first_row, end_row), in shard order

Only encoding runs out of order, and it reads no writer state: which samples land in which shard,
and every byte of every shard, are exactly what `ShardWriter.add` writes for the same samples.
A shard is written while the next one fills, and fsynced while the next one is written: on an H200
host a shard's write and its fsync took about as long as each other, and done in turn on one thread
they left the disk idle half the time, its writer the bound of the whole extraction.

Memory is bounded: `submit_many` blocks while `max_pending_tokens` tokens are submitted but not yet
appended (back-pressure on the pump), and the shard being written plus the one filling are the
only shards held (the one being fsynced is in the page cache, no longer here). The time `submit` and
`finish` spend blocked is `waited_s`.

Encode threads run torch single-threaded: the pool is the parallelism, and a pool of threads that
each open a full intra-op OpenMP team oversubscribes the cores (on a loaded 2-core host that made
quantization ~50x slower).

`busy()` says which stage of the pipeline is the bound: the seconds each one spent working or
blocked, by name (defined in `aerie.extract.phases`, group `commit_path`). `encode` is summed over
the pool's threads, so it can exceed the wall (up to `workers` times it); the others are one
thread's time each.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from aerie.errors import ExtractionError
from aerie.extract.phases import COMMITTER_STEPS
from aerie.shards.files import WrittenShard
from aerie.shards.format import HiddenSample, ShardInfo
from aerie.shards.writer import EncodedRows, SealedShard, ShardWriter

log = logging.getLogger(__name__)

# Rows per encode task: long samples are split so the pool stays balanced (and one very long sample
# does not stall the ordered append behind a single thread).
ENCODE_ROWS = 2048
MAX_DEFAULT_WORKERS = 16

ClosedFn = Callable[[ShardInfo, int, int], None]  # (info, first row, end row)
AppendedFn = Callable[[int], None]  # tokens of one sample, once it is in the open shard

_THREADS_LOCK = threading.Lock()


def default_workers(servers_on_host: int = 1) -> int:
    """Encode threads per server when the config leaves it open: half this host's CPUs, shared by
    its servers (the other half serves the server processes, the pumps, shard writes, hashing and
    uploads), at least 1, at most 16 (past that the shard write, not encoding, bounds a server)."""
    cpus = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_WORKERS, cpus // 2 // max(1, servers_on_host)))


def _single_threaded_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool whose threads run torch ops single-threaded, leaving the rest of the process alone.

    With the OpenMP backend the intra-op thread count is per calling thread (the OpenMP ICV, set once
    per thread from torch's global when the thread first asks), but `torch.set_num_threads` also sets
    the global. So every pool thread sets 1 for itself, all wait on a barrier, then the global is put
    back. Where the backend keeps one global count (no OpenMP), the restore wins and the pool runs
    with torch's default: slower on a busy host, but never wrong."""
    barrier = threading.Barrier(workers + 1)

    def init() -> None:
        torch.get_num_threads()  # this thread's lazy init happens now, not later over our setting
        torch.set_num_threads(1)
        barrier.wait(timeout=60)

    with _THREADS_LOCK:
        before = torch.get_num_threads()
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=init)
        try:
            # Each submit starts a thread while none is idle; the initializers hold them on the barrier.
            for _ in range(workers):
                pool.submit(lambda: None)
            barrier.wait(timeout=60)  # a thread that never starts: BrokenBarrierError, not a hang
        finally:
            torch.set_num_threads(before)
    return pool


class _BusyClock:
    """Seconds per named step and counts, added from any of the pipeline's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(COMMITTER_STEPS, 0.0)
        self._counts = {"shards": 0, "shard_bytes": 0}

    def add(self, **seconds: float) -> None:
        with self._lock:
            for name, value in seconds.items():
                self._seconds[name] += value

    def count(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                self._counts[name] += value

    def seconds(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class ShardCommitter:
    """Feeds `writer` from a pool of encode threads; see the module docstring. Not thread-safe
    itself: one thread calls `submit`, `finish`, `drain` and `close` (the slice's pump)."""

    def __init__(
        self,
        writer: ShardWriter,
        *,
        first_row: int,
        workers: int,
        max_pending_tokens: int,
        on_closed: ClosedFn,
        on_appended: AppendedFn | None = None,
        encode_rows: int = ENCODE_ROWS,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.writer = writer
        self.next_row = first_row
        self.max_pending_tokens = max_pending_tokens
        self.encode_rows = encode_rows
        self.waited_s = 0.0
        self._busy = _BusyClock()
        self._on_closed = on_closed
        self._on_appended = on_appended
        self._cond = threading.Condition()
        self._pending_tokens = 0
        self._failure: BaseException | None = None
        self._cancelled = False
        self._write_slot = threading.Semaphore(1)  # one shard written while the next one fills
        self._sync_slot = threading.Semaphore(1)  # one shard fsynced while the next one is written
        self._encode = _single_threaded_pool(workers, "aerie-commit-encode")
        self._append_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aerie-commit-append")
        self._write_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aerie-commit-write")
        self._sync_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aerie-commit-sync")

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def busy(self) -> dict[str, float]:
        """Seconds each step of the pipeline has spent so far, by name (`COMMITTER_STEPS`; see the module
        docstring and `aerie.extract.phases`). Safe from any thread; final once `finish` returns."""
        return self._busy.seconds()

    def counts(self) -> dict[str, int]:
        """Shards written so far and their bytes."""
        return self._busy.counts()

    # -- the caller's side ---------------------------------------------------------------------------

    def submit(self, sample: HiddenSample) -> None:
        """`submit_many` of one sample."""
        self.submit_many([sample])

    def submit_many(self, samples: list[HiddenSample]) -> None:
        """Queue the next rows' samples (one request's, in row order) as one task; blocks while the
        pipeline holds `max_pending_tokens`. Raises the pipeline's first failure (a bad sample, a shard
        that could not be written).

        A batch is one hand-off to the append thread, not one per sample: on an H200 host the pump
        handed ~460 samples a second over, and each hop between threads waits for the GIL. Samples that
        need no encoding (already the shard's dtype, or fp8 from the server) skip the encode pool."""
        self._raise_failure()
        if not samples:
            return
        tokens = [self.writer.check(s) for s in samples]
        total = sum(tokens)
        began = time.monotonic()
        with self._cond:
            # A batch larger than the budget still goes in, alone.
            while (
                not (self._failure or self._cancelled)
                and self._pending_tokens
                and self._pending_tokens + total > self.max_pending_tokens
            ):
                self._cond.wait()
            self._pending_tokens += total
        self.waited_s += time.monotonic() - began
        self._raise_failure()
        encoded = [self._encode_parts(s, t) for s, t in zip(samples, tokens, strict=True)]
        first = self.next_row
        self.next_row += len(samples)
        # The callbacks run on the pipeline's threads with the caller's context variables (Prefect's
        # run context among them: progress artifacts are updated from there), as asyncio.to_thread does.
        self._append_pool.submit(
            contextvars.copy_context().run, self._append, first, samples, encoded, tokens
        )

    def _encode_parts(self, sample: HiddenSample, tokens: int) -> list[Future[EncodedRows]] | None:
        """The sample's encode tasks on the pool, in row ranges; None when encoding is only slicing
        (the append thread does it then)."""
        if not self.writer.needs_encoding(sample):
            return None
        return [
            self._encode.submit(self._encode_rows, sample, lo, min(lo + self.encode_rows, tokens))
            for lo in range(0, tokens, self.encode_rows)
        ]

    def drain(self) -> None:
        """Wait until every submitted sample is in the open shard and every closed shard is written
        and reported; the open shard stays open. Raises the pipeline's first failure."""
        began = time.monotonic()
        try:
            # Each thread runs in order and hands on before it takes its next task.
            for pool in (self._append_pool, self._write_pool, self._sync_pool):
                pool.submit(lambda: None).result()
        finally:
            self.waited_s += time.monotonic() - began
        self._raise_failure()

    def finish(self) -> None:
        """Drain, then write the open shard (its end row: the next row to submit)."""
        self.drain()
        began = time.monotonic()
        try:
            sealed = self._append_pool.submit(self.writer.seal).result()
            if sealed is not None:
                self._write_behind(sealed, end_row=self.next_row)[0].result()
                self._sync_pool.submit(lambda: None).result()
        finally:
            self.waited_s += time.monotonic() - began
        self._raise_failure()

    def close(self) -> None:
        """Stop the threads. Work still queued (after a failure, without `drain`) is dropped: no
        sample is half in a shard, the open shard is never written, and a shard already being
        written finishes (its temp file is renamed or removed, never left half-written)."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()
        self._encode.shutdown(wait=True, cancel_futures=True)
        self._append_pool.shutdown(wait=True, cancel_futures=True)
        self._write_pool.shutdown(wait=True)
        self._sync_pool.shutdown(wait=True)

    # -- the pipeline's threads -----------------------------------------------------------------------

    def _encode_rows(self, sample: HiddenSample, lo: int, hi: int) -> EncodedRows:
        began = time.perf_counter()
        try:
            return self.writer.encode(sample, lo, hi)
        finally:
            self._busy.add(encode=time.perf_counter() - began)

    def _append(
        self,
        first_row: int,
        samples: list[HiddenSample],
        encoded: list[list[Future[EncodedRows]] | None],
        tokens: list[int],
    ) -> None:
        try:
            for i, (sample, parts, t) in enumerate(zip(samples, encoded, tokens, strict=True)):
                if self._failure is not None or self._cancelled:
                    return
                self._append_one(first_row + i, sample, parts, t)
        except BaseException as exc:
            self._fail(exc)
        finally:
            with self._cond:
                self._pending_tokens -= sum(tokens)
                self._cond.notify_all()

    def _append_one(
        self, row: int, sample: HiddenSample, parts: list[Future[EncodedRows]] | None, tokens: int
    ) -> None:
        began = time.perf_counter()
        rows = [p.result() for p in parts] if parts is not None else [self.writer.encode(sample, 0, tokens)]
        encoded = time.perf_counter()
        slot_wait = 0.0
        try:
            sealed = self.writer.append(sample, rows)
            if sealed is not None:  # the shard of the rows before this one is complete
                slot_wait = self._write_behind(sealed, end_row=row)[1]
            if self._on_appended is not None:
                self._on_appended(tokens)
        finally:
            own = time.perf_counter() - encoded - slot_wait
            if parts is None:  # encoded here: the append thread's own work
                self._busy.add(append=own + encoded - began)
            else:
                self._busy.add(append_wait_encode=encoded - began, append=own)

    def _write_behind(self, sealed: SealedShard, end_row: int) -> tuple[Future[None], float]:
        """Write `sealed` (rows up to `end_row`) on the write thread; waits only while the previous
        shard is still being written (then the disk, not the caller, is the bound). Returns the
        write's future and the seconds waited."""
        began = time.perf_counter()
        self._write_slot.acquire()
        waited = time.perf_counter() - began
        self._busy.add(write_slot_wait=waited)
        first_row = end_row - len(sealed.sample_ids)
        future = self._write_pool.submit(
            contextvars.copy_context().run, self._write, sealed, first_row, end_row
        )
        return future, waited

    def _write(self, sealed: SealedShard, first_row: int, end_row: int) -> None:
        try:
            if self._failure is not None:
                return
            began = time.perf_counter()
            written = sealed.write_data()
            wrote = time.perf_counter()
            self._busy.add(write=wrote - began, write_data=written.data_s)
            self._sync_slot.acquire()  # the previous shard's fsync is done: the disk is the bound
            self._busy.add(sync_slot_wait=time.perf_counter() - wrote)
            try:
                self._sync_pool.submit(
                    contextvars.copy_context().run, self._sync, written, first_row, end_row
                )
            except BaseException:
                self._sync_slot.release()
                written.discard()
                raise
        except BaseException as exc:
            self._fail(exc)
        finally:
            self._write_slot.release()

    def _sync(self, written: WrittenShard, first_row: int, end_row: int) -> None:
        try:
            if self._failure is not None:
                written.discard()
                return
            began = time.perf_counter()
            info = written.sync()
            synced = time.perf_counter()
            t = info.timing
            self._busy.add(sync=synced - began, write_hash_wait=t.hash_wait, write_fsync=t.fsync)
            self._busy.count(shards=1, shard_bytes=info.bytes)
            try:
                self._on_closed(info, first_row, end_row)
            finally:
                self._busy.add(on_closed=time.perf_counter() - synced)
        except BaseException as exc:
            self._fail(exc)
        finally:
            self._sync_slot.release()

    def _fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = exc
            self._cond.notify_all()

    def _raise_failure(self) -> None:
        exc = self._failure
        if exc is None:
            return
        if isinstance(exc, ExtractionError):
            raise exc
        raise ExtractionError(
            f"committing samples to {self.writer.prefix}-*.safetensors in {self.writer.out_dir} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
