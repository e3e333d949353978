"""Temporary work folders that a later run can recognise and remove when their owner was killed.

A `tempfile.TemporaryDirectory` is removed when its `with` ends, also on an exception or Ctrl-C, but
never after SIGKILL (the OOM killer, `kill -9`, a lost host): a merge's spill, which can be as large as
the corpus, then stays in `$TMPDIR` for good. `work_dir(prefix)` names its folder after its owner,

    <tempdir>/<prefix><host>-<pid>-<start>-<random>      e.g. aerie-merge-3f2a9c1e-41377-8812345-k2j4

(`host`: a hash of this machine's name and pid namespace, `start`: the owner's process start time in
clock ticks, so a reused pid is not taken for the owner), and on entry removes every such folder of
this machine whose owner is no longer running. Folders of other machines or containers (a shared `$TMPDIR`) are left
alone.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from aerie.errors import ConfigError

log = logging.getLogger(__name__)

PREFIX = "aerie-"
_OWNED = re.compile(r"(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-(?P<start>\d+)-[^-]+$")


def host_tag() -> str:
    """This machine, and this pid namespace on it: a container sharing the host's name and `$TMPDIR`
    numbers its processes apart, so its folders' pids say nothing here."""
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        namespace = ""
    return hashlib.sha256(f"{socket.gethostname()}/{namespace}".encode()).hexdigest()[:8]


def process_start(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (Linux /proc), or None where it is
    unknown (no such process, or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count fields after its last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])  # field 22 of stat(5)


def is_running(pid: int, start: int) -> bool:
    """Whether the process that made a folder still runs: `pid` alive and, where /proc tells, started
    when the folder's name says (else the pid was reused by another process)."""
    if Path("/proc/self/stat").exists():
        return process_start(pid) == start
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def sweep_stale(parent: str | Path | None = None) -> list[Path]:
    """Remove the work folders under `parent` (default: the temp dir) that this machine's stopped
    processes left; return them."""
    parent = Path(parent or tempfile.gettempdir())
    host = host_tag()
    removed = []
    try:
        candidates = [p for p in parent.iterdir() if p.name.startswith(PREFIX)]
    except OSError:
        return []
    for path in candidates:
        owner = _OWNED.search(path.name)
        if owner is None or owner["host"] != host or not path.is_dir():
            continue
        if is_running(int(owner["pid"]), int(owner["start"])):
            continue
        shutil.rmtree(path, ignore_errors=True)  # another run may be removing it at the same time
        if not path.exists():
            removed.append(path)
    if removed:
        log.warning(
            "removed %d work folder(s) that stopped runs left in %s: %s",
            len(removed),
            parent,
            ", ".join(p.name for p in removed),
        )
    return removed


@contextmanager
def work_dir(prefix: str) -> Iterator[Path]:
    """A temporary folder named for this process (`aerie-merge-` ... ), removed when the `with` ends;
    what killed runs left before it is removed first."""
    assert prefix.startswith(PREFIX) and prefix.endswith("-"), prefix
    sweep_stale()
    pid = os.getpid()
    owner = f"{prefix}{host_tag()}-{pid}-{process_start(pid) or 0}-"
    try:
        made = tempfile.TemporaryDirectory(prefix=owner)
    except OSError as exc:
        raise ConfigError(
            f"cannot make a work folder in {tempfile.gettempdir()} ({exc.strerror or exc}): set TMPDIR to "
            "a writable directory with room for the work"
        ) from exc
    with made as tmp:
        yield Path(tmp)
