"""Tokenizing batches in `num_workers` spawned processes (`aerie.corpus.worker`), a bounded number in
flight so memory does not grow with the corpus; with one worker, in this process."""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import pickle
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import polars as pl

from aerie.corpus import worker
from aerie.corpus.encoding import BatchEncoder, BatchResult, EncodeOptions
from aerie.corpus.template import TemplateSpec
from aerie.errors import DataError


def to_ipc(batch: pl.DataFrame) -> bytes:
    """A batch as Arrow IPC file bytes, for the trip to a worker.

    Not pickle: Polars strings are views into shared data buffers, and a pickled batch of 256 rows
    carries every buffer its strings point into (measured: 105 MB per batch, the whole input file),
    while the IPC file writer copies out only the bytes the rows use (~1 MB).
    """
    buffer = io.BytesIO()
    batch.write_ipc(buffer, compression="uncompressed")
    return buffer.getvalue()


Encode = Callable[[Iterable[pl.DataFrame]], Iterator[BatchResult]]


@contextlib.contextmanager
def encoder_pool(spec: TemplateSpec, options: EncodeOptions, num_workers: int) -> Iterator[Encode]:
    """Yield a function that maps batches to results in order, `num_workers` processes at a time and
    at most two batches per process in flight (memory stays flat however long the input is).

    A worker that dies (killed for memory, a crash in native code) raises `DataError` instead of
    leaving the run waiting forever, which is why this is a ProcessPoolExecutor and not a Pool.
    """
    if num_workers <= 1:
        encoder = BatchEncoder(spec, options)
        yield lambda batches: (encoder(b) for b in batches)
        return
    # spawn, not fork: the parent runs Polars and tokenizers thread pools that a fork would copy mid-flight.
    executor = ProcessPoolExecutor(
        max_workers=num_workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=worker.initialize,
        initargs=(pickle.dumps((spec, options)),),
    )

    def run(batches: Iterable[pl.DataFrame]) -> Iterator[BatchResult]:
        in_flight: deque[Future[BatchResult]] = deque()
        try:
            for batch in batches:
                in_flight.append(executor.submit(worker.encode, to_ipc(batch)))
                if len(in_flight) >= 2 * num_workers:
                    yield in_flight.popleft().result()
            while in_flight:
                yield in_flight.popleft().result()
        except BrokenProcessPool as exc:
            raise DataError(
                f"a tokenization worker process died ({exc}); if it was killed for memory, lower "
                "corpus.num_workers or corpus.batch_rows. A spawned worker also dies if the main script "
                "starts work at import time: guard it with `if __name__ == '__main__':`"
            ) from exc

    try:
        yield run
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
