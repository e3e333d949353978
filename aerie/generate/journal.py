"""The resumable, append-only journal of one dataset's generation.

Each run appends finished conversations to its own part file (`part-<n>-<tag>.jsonl`) and failures to
`errors-<n>-<tag>.jsonl`. A writer thread commits in groups: it takes every record waiting, writes
them, flushes and fsyncs, then takes the next group; a record is durable within one fsync of its
conversation finishing, and the event loop never blocks on the disk. A kill -9 can only tear the
last line of the newest part, which the reader drops; the next run writes a new part, so a torn line
is never followed by a good one. A lock file keeps two processes from generating into one journal.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from aerie.diskspace import free_text
from aerie.errors import StoreError
from aerie.hostlock import HeldElsewhere, HostLock

PART_GLOB = "part-*.jsonl"
TIME_GLOB = "time-*.jsonl"  # one per run: the seconds it generated for (*.jsonl: the mirror carries it)
_STOP = object()


def _fsync_dir(path: Path) -> None:
    """Make a new file's directory entry durable, not only its contents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The complete records of a journal file; an unterminated or unparsable last line (a write torn
    by a kill) is dropped. A bad line anywhere else is corruption and raises."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    # After a clean write the data ends in "\n", so the last element is b""; anything else was torn.
    for number, line in enumerate(lines[:-1], start=1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except ValueError as exc:
            if number == len(lines) - 1:
                return
            raise StoreError(f"{path}:{number}: corrupt journal line (not JSON): {exc}") from exc


class Journal:
    """Open with `with Journal(dir, params_hash) as journal:`; `append()`/`append_error()` are
    thread-safe and cheap, `done()` lists what earlier runs finished."""

    def __init__(self, directory: str | Path, params_hash: str, lead_s: float = 0.0) -> None:
        """`lead_s`: what this run spent before it could generate (starting the server it generates
        with), counted in its time: a GPU held for a server's start is held for the stage."""
        self.dir = Path(directory)
        self.params_hash = params_hash
        self.lead_s = lead_s
        self._queue: queue.Queue[Any] = queue.Queue()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._lock: HostLock | None = None
        self.part: Path | None = None
        self.errors_part: Path | None = None
        self.time_file: Path | None = None

    def __enter__(self) -> Journal:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        lock = HostLock(self.dir / ".lock")
        try:
            lock.acquire()
        except HeldElsewhere as exc:
            raise StoreError(
                f"another generation is writing to {self.dir} (pid {exc.holder}); wait for it or stop it"
            ) from exc
        except OSError as exc:
            raise StoreError(f"cannot create the generation journal in {self.dir}: {exc}") from exc
        self._lock = lock
        n = 1 + max((int(p.name.split("-")[1]) for p in self.dir.glob(PART_GLOB)), default=0)
        tag = uuid.uuid4().hex[:8]  # unique across machines sharing one remote journal
        self.part = self.dir / f"part-{n:05d}-{tag}.jsonl"
        self.errors_part = self.dir / f"errors-{n:05d}-{tag}.jsonl"
        self.time_file = self.dir / f"time-{n:05d}-{tag}.jsonl"
        self._thread = threading.Thread(target=self._write_loop, name="aerie-journal", daemon=True)
        self._thread.start()

    def records(self) -> dict[tuple[str, str], dict[str, Any]]:
        """Every finished record of earlier runs (and this one, once flushed) under these parameters,
        by (id, input digest): the first copy of each. A record of a journal written before records
        carried their input's digest has none and matches no conversation (it is generated again)."""
        found: dict[tuple[str, str], dict[str, Any]] = {}
        for path in sorted(self.dir.glob(PART_GLOB)):
            for rec in read_jsonl(path):
                if rec.get("params_hash") == self.params_hash:
                    found.setdefault((rec["id"], rec.get("input_sha256") or ""), rec)
        return found

    def record_seconds(self, seconds: float) -> None:
        """This run's time so far, its `lead_s` included (rewritten as it grows, so a killed run keeps
        what it spent up to its last record): what the manifest's time sums over resumed runs."""
        assert self.time_file is not None, "record_seconds needs an open journal"
        line = json.dumps(
            {
                "params_hash": self.params_hash,
                "seconds": round(seconds + self.lead_s, 3),
                "server_start_s": round(self.lead_s, 3),
            }
        )
        tmp = self.dir / ".time.tmp"
        tmp.write_text(line + "\n")
        os.replace(tmp, self.time_file)

    def earlier_runs(self) -> tuple[int, float]:
        """(runs before this one, the seconds they spent, server starts included), from their time files."""
        runs, seconds = 0, 0.0
        for path in sorted(self.dir.glob(TIME_GLOB)):
            if path == self.time_file:
                continue
            for rec in read_jsonl(path):
                if rec.get("params_hash") == self.params_hash:
                    runs += 1
                    seconds += float(rec.get("seconds", 0.0))
        return runs, seconds

    def done(self) -> set[tuple[str, str]]:
        """(id, input digest) of every finished record: what a conversation resumes from."""
        return set(self.records())

    def append(self, record: dict[str, Any]) -> None:
        self._check()
        self._queue.put(("part", record))

    def append_error(self, record: dict[str, Any]) -> None:
        self._check()
        self._queue.put(("errors", record))

    def flush(self) -> None:
        """Block until everything appended so far is on disk."""
        done = threading.Event()
        self._queue.put(done)
        while not done.wait(0.5):
            if self._thread is None or not self._thread.is_alive():
                break
        self._check()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self._check()

    def _check(self) -> None:
        if self._error is not None:
            raise StoreError(
                f"cannot write the generation journal in {self.dir} ({free_text(self.dir)}): {self._error}"
            ) from self._error

    def _write_loop(self) -> None:
        assert self.part is not None and self.errors_part is not None
        files: dict[str, IO[bytes]] = {}
        try:
            stop = False
            while not stop:
                batch = [self._queue.get()]
                while True:  # group commit: everything that is already waiting goes in one fsync
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                waiters = [item for item in batch if isinstance(item, threading.Event)]
                stop = any(item is _STOP for item in batch)
                touched = set()
                for item in batch:
                    if isinstance(item, tuple):
                        name, rec = item
                        f = files.get(name) or self._open_part(files, name)
                        f.write(json.dumps(rec, ensure_ascii=False).encode() + b"\n")
                        touched.add(name)
                for name in touched:
                    files[name].flush()
                    os.fsync(files[name].fileno())
                for waiter in waiters:
                    waiter.set()
        except BaseException as exc:  # surfaced to the producer on its next append()/flush()/close()
            self._error = exc
            while True:  # release anyone blocked in flush()
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, threading.Event):
                    item.set()
        finally:
            for f in files.values():
                try:
                    f.close()
                except OSError as exc:  # flushing the rest fails as the write did (a full disk): keep
                    self._error = self._error or exc  # the first error, for the producer to raise

    def _open_part(self, files: dict[str, IO[bytes]], name: str) -> IO[bytes]:
        path = self.part if name == "part" else self.errors_part
        assert path is not None
        files[name] = open(path, "ab")  # noqa: SIM115 - closed when the writer stops
        _fsync_dir(self.dir)
        return files[name]
