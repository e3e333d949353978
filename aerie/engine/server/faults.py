"""Faults the reference server can be told to inject, to prove it survives them (tests and benchmarks).

`AERIE_REFSERVER_FAULTS` holds comma-separated `name=SKIP:COUNT` entries: the fault point `name`
passes its first SKIP visits, then fails the next COUNT (COUNT `*`: every one after SKIP).

| name | where | raises |
|---|---|---|
| `kv_alloc` | each KV cache buffer the slot decoder allocates | `torch.OutOfMemoryError`, as a full device does |
| `step` | each generation step: a prefill of newcomers or a decoding step | `RuntimeError` (a step that keeps failing) |

`AERIE_REFSERVER_FAULTS_ONCE`, a path, makes the faults one launch's: the first server that finds no
file there creates it and injects them; servers launched after it (a relaunch) inject none.

Unset (the normal case) every point is a no-op. The warm-up request (a prefill and up to 7 decoding
steps) and the first health probe (a prefill) allocate and step too: a SKIP that lets them pass keeps
the server starting.
"""

from __future__ import annotations

import os
import threading

import torch

FAULTS_ENV = "AERIE_REFSERVER_FAULTS"
ONCE_ENV = "AERIE_REFSERVER_FAULTS_ONCE"
_POINTS = ("kv_alloc", "step")


class _Point:
    def __init__(self, skip: int, count: int | None) -> None:
        self.skip, self.count, self.seen = skip, count, 0

    def fires(self) -> bool:
        self.seen += 1
        past = self.seen - self.skip
        return past > 0 and (self.count is None or past <= self.count)


def parse(spec: str) -> dict[str, _Point]:
    """`kv_alloc=3:1,step=10:*` -> the fault points; ValueError naming the bad entry."""
    points: dict[str, _Point] = {}
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        name, _, window = entry.partition("=")
        skip, _, count = window.partition(":")
        if name not in _POINTS or not skip.isdigit() or not (count == "*" or count.isdigit()):
            raise ValueError(
                f"{FAULTS_ENV}: {entry!r} is not name=SKIP:COUNT with name one of {', '.join(_POINTS)} "
                "and COUNT a number or *"
            )
        points[name] = _Point(int(skip), None if count == "*" else int(count))
    return points


_lock = threading.Lock()


def _first_launch() -> bool:
    """True unless `ONCE_ENV` names a file an earlier launch created (this launch creates it)."""
    mark = os.environ.get(ONCE_ENV)
    if not mark:
        return True
    try:
        with open(mark, "x"):
            return True
    except FileExistsError:
        return False


_points: dict[str, _Point] = parse(os.environ.get(FAULTS_ENV, "")) if _first_launch() else {}


def hit(name: str) -> None:
    """Raise the fault of point `name` if it is due now."""
    if not _points:
        return
    with _lock:
        point = _points.get(name)
        due = point is not None and point.fires()
    if not due:
        return
    if name == "kv_alloc":
        raise torch.OutOfMemoryError(
            f"injected by {FAULTS_ENV} ({name}): out of memory allocating the KV cache"
        )
    raise RuntimeError(f"injected by {FAULTS_ENV} ({name}): the decoding step failed")
