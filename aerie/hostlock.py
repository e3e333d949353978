"""One process at a time per piece of work on a host: an exclusive `flock` on a lock file.

Two processes writing one generation journal, or extracting the same slice of one extraction stage,
would corrupt each other's files (the second extraction's server wipes the first one's dump
directory at its start). The lock is taken without waiting: the second process fails at once, naming
the holder's pid, which the holder writes into the file. The kernel drops the lock when its holder
exits, even by SIGKILL, so a stale lock file never blocks a re-run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO


class HeldElsewhere(Exception):
    """Another process holds the lock; `holder` is its pid as it wrote it ("unknown" if it did not)."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is locked by pid {holder}")
        self.path, self.holder = path, holder


class HostLock:
    """`with HostLock(path):` holds an exclusive lock on `path` (created with its parents), or raises
    `HeldElsewhere` at once; OSError where the file cannot be created (callers translate both)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 - held until release()
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise HeldElsewhere(self.path, holder) from exc
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing releases the flock
            self._file = None

    def __enter__(self) -> HostLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def held(path: Path, error: Callable[[str], Exception], doing: str, lock_name: str) -> Iterator[None]:
    """`HostLock(path)` held for the block, its failures raised as `error`: "another process (pid N) is
    `doing` (lock ...); wait for it or stop it", or "cannot create `lock_name`: <OSError>"."""
    lock = HostLock(path)
    try:
        lock.acquire()
    except HeldElsewhere as exc:
        raise error(
            f"another process (pid {exc.holder}) is {doing} (lock {exc.path}); wait for it or stop it"
        ) from exc
    except OSError as exc:
        raise error(f"cannot create {lock_name}: {exc}") from exc
    try:
        yield
    finally:
        lock.release()
