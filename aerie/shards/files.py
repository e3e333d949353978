"""One shard's bytes to disk, durably: the safetensors layout streamed to a temp file beside the
shard, its sha256 taken on a thread of its own while writing, then flush, fsync, rename and an fsync of
the directory. `write_data` and `WrittenShard.sync` are apart so a commit pipeline can fsync one shard
while it writes the next."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from aerie.diskspace import cannot_write
from aerie.errors import ExtractionError
from aerie.shards.format import ShardInfo, WriteTiming
from aerie.tensorfile import TensorParts, layout, open_direct, write_all, write_direct


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _HashBehind:
    """sha256 fed from a second thread, in order, so hashing a shard overlaps writing it: both
    release the GIL on large buffers, and a shard then costs max(write, hash) instead of their sum
    (sha256 runs at about the speed of a page-cache write)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aerie-shard-hash")

    def update(self, parts: list[memoryview]) -> None:
        """Hash `parts` in order, after what came before: one task, so a shard's thousand parts cost
        one hand-off to the hash thread, not one each."""
        self._pool.submit(self._update, list(parts))

    def _update(self, parts: list[memoryview]) -> None:
        for part in parts:
            self._h.update(part)

    def hexdigest(self) -> str:
        self._pool.shutdown(wait=True)
        return self._h.hexdigest()

    def cancel(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class WrittenShard:
    """A shard's bytes in its temp file, not yet durable. `sync` makes it the shard (flush, fsync,
    rename, fsync of the directory) and returns its info; `discard` removes the temp file. Writing and
    syncing are apart so a commit pipeline can fsync one shard while it writes the next: the disk then
    never waits for the writer between shards."""

    def __init__(self, info: ShardInfo, tmp: Path, f: BinaryIO, hasher: _HashBehind, data_s: float) -> None:
        self._info = info
        self._tmp = tmp
        self._f = f
        self._hasher = hasher
        self._data_s = data_s

    @property
    def data_s(self) -> float:
        """Seconds the data took to write (the writev calls)."""
        return self._data_s

    def sync(self) -> ShardInfo:
        began = time.perf_counter()
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            synced = time.perf_counter()
            digest = self._hasher.hexdigest()
            hashed = time.perf_counter()
            os.replace(self._tmp, self._info.path)
            _fsync_dir(self._info.path.parent)
        except BaseException as exc:
            _drop_temp(self._hasher, self._f, self._tmp)
            if isinstance(exc, OSError):
                raise _cannot_write_shard(self._info.path, exc) from exc
            raise
        timing = WriteTiming(
            data=self._data_s, hash_wait=hashed - synced, fsync=synced - began + time.perf_counter() - hashed
        )
        return dataclasses.replace(self._info, sha256=digest, timing=timing)

    def discard(self) -> None:
        """Drop the temp file: this shard will not be written (its pipeline failed or stopped)."""
        _drop_temp(self._hasher, self._f, self._tmp)


def _drop_temp(hasher: _HashBehind, f: BinaryIO | None, tmp: Path) -> None:
    """Stop hashing, close and remove a shard's temp file; cleanup must not hide why the write failed."""
    hasher.cancel()
    if f is not None:
        with contextlib.suppress(OSError):
            f.close()
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)


def _cannot_write_shard(path: Path, exc: OSError) -> ExtractionError:
    return ExtractionError(cannot_write(path, exc, "shard"))


_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def write_data(
    info: ShardInfo, tensors: list[TensorParts], metadata: dict[str, str], direct_io: bool
) -> WrittenShard:
    """Write the safetensors layout to a temp file beside `info.path`, streaming each tensor's
    chunks (`aerie.tensorfile`) and hashing them in a second thread. With `direct_io` the file is
    written with O_DIRECT where its filesystem takes it (`aerie.tensorfile.write_direct`)."""
    parts, size = layout(tensors, metadata)
    tmp = info.path.with_name(f".{info.path.name}.tmp")
    # Hashed on the shard's own thread: a shard's hash (slower than its write on the H200 hosts, whose
    # sync threads waited on it 10-25% of the wall, `write_hash_wait`) then overlaps the writing of the
    # next shard instead of holding up this one's writes.
    h = _HashBehind()
    f: BinaryIO | None = None
    try:
        fd, direct = open_direct(tmp) if direct_io else (os.open(tmp, _NEW_FILE, 0o644), False)
        f = open(fd, "wb", buffering=0)  # noqa: SIM115 - closed by WrittenShard.sync or discard
        began = time.perf_counter()
        h.update(parts)
        (write_direct if direct else write_all)(fd, parts)
        data_s = time.perf_counter() - began
    except BaseException as exc:
        _drop_temp(h, f, tmp)
        if isinstance(exc, OSError):
            raise _cannot_write_shard(info.path, exc) from exc
        raise
    return WrittenShard(dataclasses.replace(info, bytes=size), tmp, f, h, data_s)
