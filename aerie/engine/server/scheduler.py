"""The one thread that touches the model, and the queues that feed it.

HTTP handlers never run the model: they enqueue work and await a future. A single worker thread
owns the model (no locks around torch state, no interleaved KV caches) and loops:

1. take waiting prefill-only (extraction) sequences up to `max_batch_tokens`, run ONE packed forward
   for all of them (across requests), and hand the per-sequence tensors to a writer pool that writes
   the dump files while the next forward runs;
2. admit waiting generation requests into the running batch (prefill);
3. run one decoding step of the running batch.

`phases` adds up where the wall time goes (`PhaseClock`; /server_info's `extract_phases_s`), so a
slow extraction says whether the forward, the copies, the dump writers or the feed sets its pace.

`last_progress` records when a model step last completed: `/health` is healthy when any step
completes after the probe started, the signal SGLang uses.

A failed step fails its batch, not the server. An allocation failure (`torch.OutOfMemoryError`)
first has the backend drop what could point at freed memory (`release_memory`: the KV cache and the
CUDA graphs captured on it), and its requests wait to be admitted again (at most `_OOM_RETRIES`
times each; a streamed one, whose tokens went out, fails). A request the cache could never hold is
refused (`RequestError`, a 400 naming the sizes). After `unhealthy_after` failed steps in a row the
server reports itself unhealthy for good (`unhealthy`: /health answers 503 with the reason, and the
log line `UNHEALTHY_LINE` tells a launcher's watch to restart it): a step that keeps failing, such as
one on a device whose context an illegal memory access has poisoned, will not heal by itself.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aerie.engine.generation import GenerationBackend, GenRequest, GenResult
from aerie.engine.server import faults
from aerie.engine.server.dump import write_dump
from aerie.engine.server.extraction import HiddenStateCapture, PackCapture
from aerie.engine.server.protocol import RequestError
from aerie.engine.server.trace import PackTrace

logger = logging.getLogger("aerie.engine")

# The log line a server that has turned unhealthy writes (aerie.serving.startup_log matches it).
UNHEALTHY_LINE = "The reference server is unhealthy"
_OOM_RETRIES = 2  # times a request goes back to the queue after an allocation failure


class ServerUnhealthy(RuntimeError):
    """The server no longer serves: its steps kept failing (a 503 with the reason)."""


@dataclass
class _ExtractItem:
    rid: str
    input_ids: list[int]
    future: Future[dict[str, Any]] = field(default_factory=Future)


@dataclass
class _GenItem:
    request: GenRequest
    future: Future[GenResult] = field(default_factory=Future)
    oom_retries: int = 0


@dataclass
class SchedulerStats:
    """Counters for /server_info and the periodic log line."""

    prefill_tokens: int = 0
    generated_tokens: int = 0
    extracted_sequences: int = 0
    extracted_tokens: int = 0
    dumps_written: int = 0
    failures: int = 0
    failures_in_a_row: int = 0
    oom_recoveries: int = 0  # allocation failures the backend recovered from
    peak_running: int = 0  # most requests decoded together so far (proves batching happened)


class PhaseClock:
    """Seconds spent per phase since the model thread started; `snapshot()` is what /server_info shows.

    The model thread's time splits into `idle` (no work queued), `write_slot_wait` (back-pressure: every
    writer slot held by packs not yet written), `capture` (its own time in `HiddenStateCapture.start`:
    building the pack and running or launching the forward; on CUDA the copy is not waited for here),
    `generate` (prefills and decoding steps) and what is left (bookkeeping). `forward` and `copy` are
    the pack forwards and device->host copies: host clock on the CPU (so within `capture`), GPU time
    from CUDA events on CUDA (overlapping the model thread). The dump writers add `dump_copy_wait`
    (waiting for a pack's copy to land), `dump_write` (serialize and rename), both summed over the
    writer threads (up to `writer_threads` x wall), and `writers_busy`, the wall time at least one of
    them was working. `request_parse` / `reply_build` are the `/generate` handler's own time on the
    event loop (JSON, validation; building and serializing the reply), outside the model thread."""

    FIELDS = (
        "idle",
        "write_slot_wait",
        "capture",
        "forward",
        "copy",
        "generate",
        "dump_copy_wait",
        "dump_write",
        "writers_busy",
        "request_parse",
        "reply_build",
    )

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds = dict.fromkeys(self.FIELDS, 0.0)
        self._lock = threading.Lock()  # the model thread, the writers and the event loop all add
        self._busy = 0
        self._busy_since = 0.0
        self._idle_since: float | None = None

    def add(self, **seconds: float) -> None:
        with self._lock:
            for name, value in seconds.items():
                self.seconds[name] += value

    def idle_started(self) -> None:
        with self._lock:
            self._idle_since = time.perf_counter()

    def idle_done(self) -> None:
        with self._lock:
            if self._idle_since is not None:
                self.seconds["idle"] += time.perf_counter() - self._idle_since
            self._idle_since = None

    def writer_started(self) -> None:
        with self._lock:
            if self._busy == 0:
                self._busy_since = time.perf_counter()
            self._busy += 1

    def writer_done(self) -> None:
        with self._lock:
            self._busy -= 1
            if self._busy == 0:
                self.seconds["writers_busy"] += time.perf_counter() - self._busy_since

    def snapshot(self) -> dict[str, float]:
        """The totals so far, with `wall` (seconds since the model thread started) to take deltas of."""
        with self._lock:
            now = time.perf_counter()
            out = dict(self.seconds)
            if self._busy:  # the waits and the work in progress count up to now
                out["writers_busy"] += now - self._busy_since
            if self._idle_since is not None:
                out["idle"] += now - self._idle_since
        out["wall"] = now - self.started
        return {k: round(v, 6) for k, v in out.items()}


class Scheduler:
    """Feeds a `GenerationBackend` and a `HiddenStateCapture` from one worker thread."""

    def __init__(
        self,
        backend: GenerationBackend,
        capture: HiddenStateCapture | None,
        dump_dir: Path | None,
        *,
        max_batch_tokens: int,
        dump_metadata: dict[str, str] | None = None,
        writer_threads: int = 2,
        trace: PackTrace | None = None,
        unhealthy_after: int = 3,
    ) -> None:
        self.backend = backend
        self.unhealthy_after = unhealthy_after
        self.unhealthy = ""  # why the server no longer serves ("" while healthy)
        self.trace = trace  # profiles a few packs (--trace-packs)
        self.capture = capture
        self.dump_dir = dump_dir
        self.max_batch_tokens = max_batch_tokens
        self.dump_metadata = dump_metadata or {}
        self.stats = SchedulerStats()
        self.phases = PhaseClock()
        self.last_progress = time.monotonic()
        self._cond = threading.Condition()
        self._extract: collections.deque[_ExtractItem] = collections.deque()
        self._waiting: collections.deque[_GenItem] = collections.deque()
        self._running: dict[int, _GenItem] = {}  # id(request) -> item
        self._stop = False
        self._writers = ThreadPoolExecutor(max_workers=writer_threads, thread_name_prefix="dump-writer")
        self._write_slots = threading.Semaphore(writer_threads + 1)
        self._thread = threading.Thread(target=self._loop, name="model-worker", daemon=True)

    # -- called from the event loop -------------------------------------------------------------

    def start(self) -> None:
        self.phases = PhaseClock()  # its wall starts with the model thread
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)
        self._writers.shutdown(wait=True)

    def submit_generations(self, requests: list[GenRequest]) -> list[Future[GenResult]]:
        """Queue requests together, so the worker can admit them in one prefill."""
        items = [_GenItem(r) for r in requests]
        if self.unhealthy:
            for item in items:
                item.future.set_exception(ServerUnhealthy(self.unhealthy))
            return [i.future for i in items]
        with self._cond:
            self._waiting.extend(items)
            self._cond.notify_all()
        return [i.future for i in items]

    def submit_extractions(self, sequences: list[tuple[str, list[int]]]) -> list[Future[dict[str, Any]]]:
        """Queue (rid, input_ids) pairs together, so one request's sequences share a packed forward.
        Each future resolves to the dump's `meta_info.dump` once its file is in place."""
        if self.capture is None or self.dump_dir is None:
            raise RuntimeError("extraction needs --mode extract")
        items = [_ExtractItem(rid, ids) for rid, ids in sequences]
        if self.unhealthy:
            for ex in items:
                ex.future.set_exception(ServerUnhealthy(self.unhealthy))
            return [i.future for i in items]
        with self._cond:
            self._extract.extend(items)
            self._cond.notify_all()
        return [i.future for i in items]

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._extract)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # -- the worker thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    self.phases.idle_started()
                    while not (self._stop or self._extract or self._waiting or self._running):
                        self._cond.wait()
                    self.phases.idle_done()
                    if self._stop:
                        self._fail_everything(RuntimeError("the server is shutting down"))
                        return
                    extract = self._take_extraction()
                    admit = self._take_admissions()
                if extract:
                    if self.trace is not None:
                        self.trace.before_pack()
                    self._run_extraction(extract)
                    if self.trace is not None:
                        self.trace.after_pack()
                began, generating = time.perf_counter(), bool(admit or self._running)
                if admit:
                    self.stats.prefill_tokens += sum(len(i.request.input_ids) for i in admit)
                    requests = [i.request for i in admit]
                    self._guarded(admit, lambda: self._admit(requests))  # noqa: B023 (called at once)
                if self._running:
                    self._guarded(list(self._running.values()), self._step)
                if generating:
                    self.phases.add(generate=time.perf_counter() - began)

    def _take_extraction(self) -> list[_ExtractItem]:
        """One pack: waiting sequences, across requests, up to max_batch_tokens (a longer one alone)."""
        taken: list[_ExtractItem] = []
        tokens = 0
        while self._extract and (
            not taken or tokens + len(self._extract[0].input_ids) <= self.max_batch_tokens
        ):
            item = self._extract.popleft()
            taken.append(item)
            tokens += len(item.input_ids)
        return taken

    def _admit(self, requests: list[GenRequest]) -> list[GenResult]:
        faults.hit("step")
        return self.backend.admit(requests)

    def _step(self) -> list[GenResult]:
        faults.hit("step")
        return self.backend.step()

    def _take_admissions(self) -> list[_GenItem]:
        taken: list[_GenItem] = []
        tokens = 0
        while self._waiting:
            head = self._waiting[0]
            if not self.backend.can_admit(head.request, len(taken), tokens):
                if self._refused(head):
                    continue
                break
            taken.append(self._waiting.popleft())
            tokens += len(head.request.input_ids)
        for item in taken:
            self._running[id(item.request)] = item
        self.stats.peak_running = max(self.stats.peak_running, len(self._running))
        return taken

    def _refused(self, head: _GenItem) -> bool:
        """Fail the first waiting request if the backend could never hold it (saying why), so it does not
        wait forever; whether it did."""
        refusal = getattr(self.backend, "refusal", None)
        why = refusal(head.request) if refusal is not None else None
        if why is None:
            return False
        self._waiting.popleft()
        head.future.set_exception(RequestError(f"rid {head.request.rid}: {why}"))
        return True

    def _guarded(self, items: list[_GenItem], work: Callable[[], list[GenResult]]) -> None:
        """Run a prefill or a step; resolve finished requests; on an error fail the batch, not the server."""
        try:
            finished = work()
        except Exception as exc:  # one bad batch must not take the server down; its requests get the error
            self._failed(items, exc)
            return
        self.stats.failures_in_a_row = 0
        self.last_progress = time.monotonic()
        for result in finished:
            done = self._running.pop(id(result.request), None)
            if done is not None:
                done.future.set_result(result)
        # Every request still running, and every one that just finished, produced one token.
        self.stats.generated_tokens += len(self._running) + len(finished)
        self._stream()

    def _failed(self, items: list[_GenItem], exc: Exception) -> None:
        """A prefill or step raised: free what the failure may have left pointing at freed memory,
        requeue or fail its requests, and count it towards `unhealthy`."""
        logger.exception("generation step failed")
        self.stats.failures += 1
        oom = isinstance(exc, torch.OutOfMemoryError)
        dropped = {id(r) for r in self.backend.abort_all()} | {id(i.request) for i in items}
        # An allocation failure the backend recovered from (its memory handed back, its budget lowered)
        # is not a step that keeps failing; anything else counts towards `unhealthy`.
        recovered = oom and self._release_memory()
        if not recovered:
            self.stats.failures_in_a_row += 1
        retry: list[_GenItem] = []
        for key in dropped:
            item = self._running.pop(key, None)
            if item is None or item.future.done():
                continue
            if recovered and item.request.stream is None and item.oom_retries < _OOM_RETRIES:
                item.oom_retries += 1
                retry.append(item)
            else:
                item.future.set_exception(exc)
        with self._cond:
            self._waiting.extendleft(reversed(retry))  # first in line again, in their old order
        if self.stats.failures_in_a_row >= self.unhealthy_after and not self.unhealthy:
            self._turn_unhealthy(exc)

    def _release_memory(self) -> bool:
        """Have the backend drop what may point at freed memory; whether it could."""
        release = getattr(self.backend, "release_memory", None)
        if release is None:
            return False
        try:
            release()
        except Exception:  # the device itself is failing: the failures in a row will say so
            logger.exception("releasing memory after an allocation failure failed")
            return False
        self.stats.oom_recoveries += 1
        logger.warning(
            "Out of memory in a generation step: the KV cache and CUDA graphs were dropped (captured "
            "again on the next step); the batch's requests wait to be admitted again"
        )
        return True

    def _turn_unhealthy(self, exc: Exception) -> None:
        self.unhealthy = (
            f"{self.stats.failures_in_a_row} generation steps failed in a row; the last: "
            f"{type(exc).__name__}: {str(exc)[:300]}"
        )
        logger.error(f"{UNHEALTHY_LINE}: {self.unhealthy}. /health answers 503 from now on; restart it.")
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        for item in waiting:
            item.future.set_exception(ServerUnhealthy(self.unhealthy))

    def _stream(self) -> None:
        """Hand each streamed request that is still running its tokens so far."""
        if not any(item.request.stream is not None for item in self._running.values()):
            return
        for request, output_ids, meta in self.backend.partial():
            if request.stream is not None:
                request.stream(output_ids, meta)

    def _run_extraction(self, batch: list[_ExtractItem]) -> None:
        assert self.capture is not None
        # Back-pressure: at most `writer_threads + 1` packs captured but not yet written, so a slow
        # disk bounds host memory instead of letting captured states pile up.
        began = time.perf_counter()
        self._write_slots.acquire()
        acquired = time.perf_counter()
        try:
            pack = self.capture.start([i.input_ids for i in batch])
        except Exception as exc:  # e.g. out of memory on one pack: fail its requests only
            self._write_slots.release()
            self._fail_pack(batch, exc)
            return
        self.phases.add(write_slot_wait=acquired - began, capture=time.perf_counter() - acquired)
        if not pack.in_flight:
            self.phases.add(forward=pack.forward_s, copy=pack.copy_s)
        self.last_progress = time.monotonic()
        self.stats.failures_in_a_row = 0
        self.stats.extracted_sequences += len(batch)
        self.stats.extracted_tokens += sum(len(i.input_ids) for i in batch)
        self._writers.submit(self._write_pack, batch, pack)

    def _write_pack(self, batch: list[_ExtractItem], pack: PackCapture) -> None:
        """Wait for the pack's host copy, write its files, then reply."""
        assert self.dump_dir is not None
        self.phases.writer_started()
        try:
            if pack.in_flight:
                began = time.perf_counter()
                try:
                    pack.wait()
                except Exception as exc:  # the forward or the copy failed on the device
                    self._fail_pack(batch, exc)
                    return
                self.phases.add(
                    dump_copy_wait=time.perf_counter() - began, forward=pack.forward_s, copy=pack.copy_s
                )
            began = time.perf_counter()
            done = self._write_files(batch, pack)
            self.phases.add(dump_write=time.perf_counter() - began)
        finally:
            self.phases.writer_done()
            self._write_slots.release()
        self.stats.dumps_written += len(done)
        for item, meta in done:
            item.future.set_result(meta)

    def _fail_pack(self, batch: list[_ExtractItem], exc: Exception) -> None:
        """A pack's prefill failed (at launch, or on the device while its copy was awaited): its
        requests get the error, the server goes on."""
        logger.exception("packed prefill failed")
        self.stats.failures += 1
        self.stats.failures_in_a_row += 1
        for item in batch:
            item.future.set_exception(exc)
        if self.stats.failures_in_a_row >= self.unhealthy_after and not self.unhealthy:
            self._turn_unhealthy(exc)

    def _write_files(self, batch: list[_ExtractItem], pack: PackCapture) -> list[tuple[_ExtractItem, Any]]:
        """The pack's dump files; the items written, with their replies' dump meta. A failed item gets
        its exception here."""
        assert self.dump_dir is not None
        done: list[tuple[_ExtractItem, dict[str, Any]]] = []
        for item, cap in zip(batch, pack.captures, strict=True):
            try:
                meta = write_dump(self.dump_dir, item.rid, cap, {**self.dump_metadata, "rid": item.rid})
            except Exception as exc:  # a full disk fails this sample with the OSError text, loudly
                logger.error(f"writing the dump of rid {item.rid} failed: {exc}")
                self.stats.failures += 1
                item.future.set_exception(exc)
                continue
            done.append((item, meta))
        return done

    def _fail_everything(self, exc: Exception) -> None:
        futures: list[Future[Any]] = [i.future for i in self._extract]
        futures += [i.future for i in [*self._waiting, *self._running.values()]]
        for future in futures:
            if not future.done():
                future.set_exception(exc)
        self._extract.clear()
        self._waiting.clear()
        self._running.clear()
