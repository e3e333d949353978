"""The one thread that touches the model, and the queues that feed it.

HTTP handlers never run the model: they enqueue work and await a future. A single worker thread
owns the model (no locks around torch state, no interleaved KV caches) and loops:

1. take waiting prefill-only (extraction) sequences up to `max_batch_tokens`, run ONE packed forward
   for all of them (across requests), and hand the per-sequence tensors to a writer pool that writes
   the dump files while the next forward runs;
2. admit waiting generation requests into the running batch (prefill);
3. run one decoding step of the running batch.

`last_progress` records when a model step last completed: `/health` is healthy when any step
completes after the probe started, the signal SGLang uses (research/sglang.md §2.2).
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

from aerie.refserver.dump import fsync_dir, write_dump
from aerie.refserver.extraction import Capture, HiddenStateCapture
from aerie.refserver.generation import GenerationBackend, GenRequest, GenResult

logger = logging.getLogger("aerie.refserver")


@dataclass
class _ExtractItem:
    rid: str
    input_ids: list[int]
    future: Future[dict[str, Any]] = field(default_factory=Future)


@dataclass
class _GenItem:
    request: GenRequest
    future: Future[GenResult] = field(default_factory=Future)


@dataclass
class SchedulerStats:
    """Counters for /server_info and the periodic log line."""

    prefill_tokens: int = 0
    generated_tokens: int = 0
    extracted_sequences: int = 0
    extracted_tokens: int = 0
    dumps_written: int = 0
    failures: int = 0
    peak_running: int = 0  # most requests decoded together so far (proves batching happened)


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
    ) -> None:
        self.backend = backend
        self.capture = capture
        self.dump_dir = dump_dir
        self.max_batch_tokens = max_batch_tokens
        self.dump_metadata = dump_metadata or {}
        self.stats = SchedulerStats()
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
                    while not (self._stop or self._extract or self._waiting or self._running):
                        self._cond.wait()
                    if self._stop:
                        self._fail_everything(RuntimeError("the server is shutting down"))
                        return
                    extract = self._take_extraction()
                    admit = self._take_admissions()
                if extract:
                    self._run_extraction(extract)
                if admit:
                    self.stats.prefill_tokens += sum(len(i.request.input_ids) for i in admit)
                    requests = [i.request for i in admit]
                    self._guarded(admit, lambda: self.backend.admit(requests))  # noqa: B023 (called at once)
                if self._running:
                    self._guarded(list(self._running.values()), self.backend.step)

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

    def _take_admissions(self) -> list[_GenItem]:
        taken: list[_GenItem] = []
        tokens = 0
        while self._waiting and self.backend.can_admit(self._waiting[0].request, len(taken), tokens):
            item = self._waiting.popleft()
            taken.append(item)
            tokens += len(item.request.input_ids)
        for item in taken:
            self._running[id(item.request)] = item
        self.stats.peak_running = max(self.stats.peak_running, len(self._running))
        return taken

    def _guarded(self, items: list[_GenItem], work: Callable[[], list[GenResult]]) -> None:
        """Run a prefill or a step; resolve finished requests; on an error fail the batch, not the server."""
        try:
            finished = work()
        except Exception as exc:  # one bad batch must not take the server down; its requests get the error
            logger.exception("generation step failed")
            self.stats.failures += 1
            dropped = {id(r) for r in self.backend.abort_all()} | {id(i.request) for i in items}
            for key in dropped:
                item = self._running.pop(key, None)
                if item is not None and not item.future.done():
                    item.future.set_exception(exc)
            return
        self.last_progress = time.monotonic()
        for result in finished:
            done = self._running.pop(id(result.request), None)
            if done is not None:
                done.future.set_result(result)
        # Every request still running, and every one that just finished, produced one token.
        self.stats.generated_tokens += len(self._running) + len(finished)

    def _run_extraction(self, batch: list[_ExtractItem]) -> None:
        assert self.capture is not None
        # Back-pressure: at most `writer_threads + 1` packs captured but not yet written, so a slow
        # disk bounds host memory instead of letting captured states pile up.
        self._write_slots.acquire()
        try:
            captures = self.capture.capture([i.input_ids for i in batch])
        except Exception as exc:  # e.g. out of memory on one pack: fail its requests only
            self._write_slots.release()
            logger.exception("packed prefill failed")
            self.stats.failures += 1
            for item in batch:
                item.future.set_exception(exc)
            return
        self.last_progress = time.monotonic()
        self.stats.extracted_sequences += len(batch)
        self.stats.extracted_tokens += sum(len(i.input_ids) for i in batch)
        self._writers.submit(self._write_pack, batch, captures)

    def _write_pack(self, batch: list[_ExtractItem], captures: list[Capture]) -> None:
        """Write a pack's files, make the renames durable with one directory fsync, then reply."""
        assert self.dump_dir is not None
        done: list[tuple[_ExtractItem, dict[str, Any]]] = []
        try:
            for item, cap in zip(batch, captures, strict=True):
                try:
                    meta = write_dump(self.dump_dir, item.rid, cap, {**self.dump_metadata, "rid": item.rid})
                except Exception as exc:  # a full disk fails this sample with the OSError text, loudly
                    logger.error(f"writing the dump of rid {item.rid} failed: {exc}")
                    self.stats.failures += 1
                    item.future.set_exception(exc)
                    continue
                done.append((item, meta))
            if done:
                fsync_dir(self.dump_dir)
        except Exception as exc:
            for item, _ in done:
                item.future.set_exception(exc)
            return
        finally:
            self._write_slots.release()
        self.stats.dumps_written += len(done)
        for item, meta in done:
            item.future.set_result(meta)

    def _fail_everything(self, exc: Exception) -> None:
        futures: list[Future[Any]] = [i.future for i in self._extract]
        futures += [i.future for i in [*self._waiting, *self._running.values()]]
        for future in futures:
            if not future.done():
                future.set_exception(exc)
        self._extract.clear()
        self._waiting.clear()
        self._running.clear()
