"""Training data: hidden-state shards -> packed rows of `batch_tokens` tokens, prefetched on a thread.

Packing puts whole documents back to back in one row and cuts the last one at the row's end; the cut
remainder starts the next row as its own document, keeping its original positions (so RoPE sees the
same positions as the target did). Only the last row of an epoch is padded, so there is no padding waste
and every step has the same shape (which compiled kernels like). With `whole` (`train.split_samples:
false`) a sample that does not fit the row's remaining room starts the next row instead, the room left
padded, so every sample of up to `batch_tokens` is trained in one piece with all of its context: what
long reasoning turns need, at the price of some padding. Attention never crosses documents: each row
carries `doc_ids`.

The epoch plan is a pure function of (sample lengths, seed, epoch, batch_tokens, max_length), so a data
position is just the global batch index: DDP rank r takes batches r, r+W, r+2W, ... and a resumed run
starts at `step * W + r` without replaying anything.

Shards are read with `aerie.shards.reader.ShardReader` (layout in `aerie.shards`); fp8 codes
and their per-token scales travel to the device as they are and are dequantized there.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from aerie.draft.attention import PAD_DOC
from aerie.errors import DataError
from aerie.fp8 import dequantize_fp8
from aerie.progress import ProgressFn, no_progress
from aerie.shards.reader import ShardReader
from aerie.store import ArtifactStore


@dataclass(frozen=True)
class Piece:
    """Tokens [start, start + length) of sample `sample` (an index into SampleIndex)."""

    sample: int
    start: int
    length: int


class SampleIndex:
    """Every sample of a list of shard files: which file, where its tokens start, how long it is."""

    def __init__(self, paths: list[Path]) -> None:
        if not paths:
            raise DataError("no hidden-state shards to read")
        self.paths = paths
        shard, begin, length = [], [], []
        self.hidden_size = 0
        self.storage = ""
        for i, path in enumerate(paths):
            reader = ShardReader(path)
            if self.storage and (reader.storage, reader.hidden_size) != (self.storage, self.hidden_size):
                raise DataError(
                    f"shard {path} is {reader.storage} with hidden {reader.hidden_size}, the first was "
                    f"{self.storage} with hidden {self.hidden_size}: shards of one run must match"
                )
            self.storage, self.hidden_size = reader.storage, reader.hidden_size
            offsets = reader.offsets.numpy()
            shard.append(np.full(offsets.size - 1, i, dtype=np.int32))
            begin.append(offsets[:-1])
            length.append(offsets[1:] - offsets[:-1])
        self.shard = np.concatenate(shard)
        self.begin = np.concatenate(begin)
        self.length = np.concatenate(length)

    @classmethod
    def of_samples(
        cls, shard: np.ndarray, begin: np.ndarray, length: np.ndarray, hidden_size: int, storage: str
    ) -> SampleIndex:
        """An index of samples that are not in shard files (online training: `shard` names the corpus
        split, `begin` the row in it)."""
        view = object.__new__(cls)
        view.paths, view.hidden_size, view.storage = [], hidden_size, storage
        view.shard, view.begin, view.length = shard, begin, length
        return view

    def __len__(self) -> int:
        return int(self.shard.size)

    def subset(self, keep: np.ndarray) -> SampleIndex:
        """A view over the samples whose indices are in `keep` (used to hold samples out)."""
        view = object.__new__(SampleIndex)
        view.paths, view.hidden_size, view.storage = self.paths, self.hidden_size, self.storage
        view.shard, view.begin, view.length = self.shard[keep], self.begin[keep], self.length[keep]
        return view

    @property
    def tokens(self) -> int:
        return int(self.length.sum())


def plan_epoch(
    lengths: np.ndarray,
    batch_tokens: int,
    max_length: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    whole: bool = False,
) -> list[list[Piece]]:
    """Rows of pieces for one epoch: a seeded shuffle, samples truncated to max_length, packed and cut
    (`whole`: a sample that fits a row but not the current row's room starts the next row)."""
    order = (
        np.random.default_rng([seed, epoch]).permutation(lengths.size) if shuffle else np.arange(lengths.size)
    )
    rows: list[list[Piece]] = []
    row: list[Piece] = []
    room = batch_tokens
    for sample in order.tolist():
        start, remaining = 0, min(int(lengths[sample]), max_length)
        if whole and row and room < remaining <= batch_tokens:
            rows.append(row)
            row, room = [], batch_tokens
        while remaining > 0:
            take = min(room, remaining)
            row.append(Piece(sample, start, take))
            start, remaining, room = start + take, remaining - take, room - take
            if room == 0:
                rows.append(row)
                row, room = [], batch_tokens
    if row:
        rows.append(row)
    return rows


@dataclass
class Batch:
    """One packed row. Host side it holds the shard dtypes; `to(device, dtype)` dequantizes."""

    input_ids: Tensor  # [T] int64: x_t at row t
    loss_mask: Tensor  # [T] bool: x_t is a supervised (assistant) token
    positions: Tensor  # [T] int64: position of row t in its original sample
    doc_ids: Tensor  # [T] int32: rows of one document share an id; padding is PAD_DOC
    aux_hidden: Tensor  # [T, 3H] bf16 or fp8
    last_hidden: Tensor  # [T, H] bf16 or fp8: the target's final hidden state after its final norm
    aux_scale: Tensor | None = None  # [T, 3] for fp8: E8M0 bytes (float32 in schema-1 shards)
    last_scale: Tensor | None = None  # [T, 1]
    tokens: int = 0  # real (non-padding) tokens

    def pin_memory(self) -> Batch:
        """Page-locked copies, so the copy to the GPU can overlap compute."""

        def pin(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.pin_memory()

        return Batch(
            self.input_ids.pin_memory(),
            self.loss_mask.pin_memory(),
            self.positions.pin_memory(),
            self.doc_ids.pin_memory(),
            self.aux_hidden.pin_memory(),
            self.last_hidden.pin_memory(),
            pin(self.aux_scale),
            pin(self.last_scale),
            self.tokens,
        )

    def to(self, device: torch.device | str, dtype: torch.dtype) -> Batch:
        """On `device`, with aux/last dequantized to `dtype` (fp8 travels as fp8: half the bytes)."""

        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        aux, last = move(self.aux_hidden), move(self.last_hidden)
        assert aux is not None and last is not None
        return Batch(
            input_ids=self.input_ids.to(device, non_blocking=True),
            loss_mask=self.loss_mask.to(device, non_blocking=True),
            positions=self.positions.to(device, non_blocking=True),
            doc_ids=self.doc_ids.to(device, non_blocking=True),
            aux_hidden=_dequantize(aux, move(self.aux_scale), dtype),
            last_hidden=_dequantize(last, move(self.last_scale), dtype),
            tokens=self.tokens,
        )


def _dequantize(x: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    return x.to(dtype) if scale is None else dequantize_fp8(x, scale, dtype)


class BatchReader:
    """Assembles packed rows from token ranges of the shards (memory-mapped; fp8 stays fp8 until the device)."""

    def __init__(self, index: SampleIndex) -> None:
        self.index = index
        self._open: dict[int, ShardReader] = {}

    def read(self, piece: Piece) -> dict[str, Tensor]:
        shard = int(self.index.shard[piece.sample])
        if shard not in self._open:
            self._open[shard] = ShardReader(self.index.paths[shard])
        lo = int(self.index.begin[piece.sample]) + piece.start
        return self._open[shard].token_slice(lo, lo + piece.length, dequantize=False)

    def batch(self, pieces: list[Piece], batch_tokens: int) -> Batch:
        parts = [self.read(p) for p in pieces]
        positions = [torch.arange(p.start, p.start + p.length) for p in pieces]
        docs = [torch.full((p.length,), i, dtype=torch.int32) for i, p in enumerate(pieces)]
        tokens = sum(p.length for p in pieces)
        pad = batch_tokens - tokens
        cat = {name: torch.cat([part[name] for part in parts]) for name in parts[0]}
        if pad:  # only the epoch's last row: padding is one document of its own, never supervised
            cat = {name: torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) for name, t in cat.items()}
            positions.append(torch.arange(pad))
            docs.append(torch.full((pad,), PAD_DOC, dtype=torch.int32))
        return Batch(
            input_ids=cat["input_ids"].to(torch.int64),
            loss_mask=cat["loss_mask"].to(torch.bool),
            positions=torch.cat(positions),
            doc_ids=torch.cat(docs),
            aux_hidden=cat["aux_hidden"],
            last_hidden=cat["last_hidden"],
            aux_scale=cat.get("aux_scale"),
            last_scale=cat.get("last_scale"),
            tokens=tokens,
        )


class EpochPlans:
    """Maps a global batch index to its pieces, computing each epoch's plan once."""

    def __init__(
        self,
        index: SampleIndex,
        batch_tokens: int,
        max_length: int,
        seed: int,
        shuffle: bool = True,
        whole: bool = False,
    ) -> None:
        self.index, self.batch_tokens = index, batch_tokens
        self._plan: Callable[[int], list[list[Piece]]] = lru_cache(maxsize=2)(
            lambda epoch: plan_epoch(index.length, batch_tokens, max_length, seed, epoch, shuffle, whole)
        )
        self.batches_per_epoch = len(self._plan(0))

    def pieces(self, global_batch: int) -> list[Piece]:
        epoch, i = divmod(global_batch, self.batches_per_epoch)
        return self._plan(epoch)[i]


class DataSource(Protocol):
    """Where the trainer's packed rows come from: shard files (`ShardSource`) or extraction servers
    (`aerie.train.online.OnlineFeeder`). Both yield the rows of the same epoch plans."""

    def batches(
        self, plans: EpochPlans, first: int, stride: int, count: int | None = None
    ) -> Iterator[Batch]: ...

    def close(self) -> None: ...


class ShardSource:
    """Rows read from the extract stage's shards."""

    def batches(
        self, plans: EpochPlans, first: int, stride: int, count: int | None = None
    ) -> Iterator[Batch]:
        return batch_stream(plans, first, stride, count)

    def close(self) -> None:
        pass


def batch_stream(plans: EpochPlans, first: int, stride: int, count: int | None = None) -> Iterator[Batch]:
    """Batches first, first+stride, ... (count of them, or forever)."""
    reader = BatchReader(plans.index)
    i = 0
    while count is None or i < count:
        yield reader.batch(plans.pieces(first + i * stride), plans.batch_tokens)
        i += 1


class Prefetcher:
    """Runs an iterator on a background thread, `depth` items ahead; re-raises its errors in the consumer."""

    _DONE = object()
    POLL_S = 0.1  # how often a waiting side looks at its stop condition

    def __init__(self, source: Iterator[Batch], depth: int, pin: bool = False) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(source, pin), daemon=True, name="aerie-prefetch"
        )
        self._thread.start()

    def _run(self, source: Iterator[Batch], pin: bool) -> None:
        try:
            for item in source:
                if not self._put(item.pin_memory() if pin else item):
                    return
        except BaseException as exc:  # surfaced in __next__, never lost on the thread
            self._put(exc)
            return
        self._put(self._DONE)

    def _put(self, item: Any) -> bool:
        """Queue `item` unless closed first (a consumer that left never takes it): whether it was queued."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=self.POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Batch:
        item = self._queue.get()
        return self._unpack(item)

    def next_unless(self, stop: Callable[[], bool]) -> Batch | None:
        """The next batch, or None once `stop()` holds while waiting for it: the data can be minutes away
        (a server starting or restarting), and a stop request must not wait for it."""
        while True:
            try:
                item = self._queue.get(timeout=self.POLL_S)
            except queue.Empty:
                if stop():
                    return None
                continue
            return self._unpack(item)

    def _unpack(self, item: Any) -> Batch:
        if item is self._DONE:
            self._queue.put_nowait(item)  # every later call ends the same way, none waits
            raise StopIteration
        if isinstance(item, BaseException):
            raise DataError(f"the data loader failed: {item}") from item
        return item  # type: ignore[no-any-return]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def localize_shards(
    store: ArtifactStore, keys: list[str], cache_dir: Path, progress: ProgressFn = no_progress
) -> list[Path]:
    """Local paths of shard objects: read in place when the store is local, else downloaded once into
    `cache_dir` (the store verifies each download's sha256; a finished file is reused by a re-run)."""
    paths = []
    for i, key in enumerate(keys):
        local = store.local_path(key)
        if local is not None and local.is_file():
            paths.append(local)
            continue
        dest = cache_dir / key
        if not dest.is_file():
            tmp = dest.with_name(dest.name + ".part")
            store.get_file(key, tmp)
            tmp.replace(dest)
        paths.append(dest)
        progress((i + 1) / len(keys), f"shard {i + 1}/{len(keys)} local")
    return paths
