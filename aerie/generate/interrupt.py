"""Ctrl-C during generation: stop at once, keep what finished, say so in one line.

Datasets generate in threads; the main thread waits for them. A blocking wait can miss Ctrl-C for as
long as it blocks (a library's threads, Polars' among them, can take the signal, so the waiting thread
is never woken), so the wait wakes every `POLL_S` to let Python run its handler. On the first Ctrl-C
the requests in flight are cancelled (each generating thread's event loop cancels its task), the
threads get `GRACE_S` to flush their journals, and `Interrupted` carries one line per dataset: the
conversations kept and where; the same command resumes from there. A second Ctrl-C while generation
threads are still alive ends the process at once (exit status 130), without waiting for them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, wait
from typing import Any

from aerie.errors import Interrupted

POLL_S = 0.2
GRACE_S = 1.5
RESUME = "the same command resumes from there"

_active = 0  # generations running in this process (each in its own thread)
_active_lock = threading.Lock()


class Active:
    """`with Active():` around one dataset's generation, so a second Ctrl-C knows one is running."""

    def __enter__(self) -> Active:
        global _active
        with _active_lock:
            _active += 1
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        with _active_lock:
            _active -= 1


def _second_interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C again: with generation threads still running, leave now; otherwise the usual Ctrl-C."""
    with _active_lock:
        running = _active
    if running:
        sys.stderr.write(f"aerie: interrupted again: exiting now ({running} generation(s) not flushed)\n")
        sys.stderr.flush()
        os._exit(130)
    raise KeyboardInterrupt


def arm_second_interrupt() -> None:
    """From the first Ctrl-C on, a second one exits at once (only the main thread can set handlers).
    The handler stays: once no generation runs it behaves as Python's own Ctrl-C."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _second_interrupt)


def wait_or_interrupt(futures: Iterable[Future[Any]], cancel: Callable[[], None]) -> None:
    """Wait for every future, Ctrl-C seen within `POLL_S`. On Ctrl-C: `cancel()` the generations, give
    them `GRACE_S` to flush, then raise `Interrupted` naming what each kept."""
    pending = set(futures)
    try:
        while pending:
            _, pending = wait(pending, timeout=POLL_S)
    except KeyboardInterrupt as exc:
        arm_second_interrupt()
        cancel()
        done, _ = wait(pending, timeout=GRACE_S)
        lines = [str(f.exception()) for f in done if isinstance(f.exception(), Interrupted)]
        lines = [line.removesuffix(f"; {RESUME}") for line in lines if line]
        lines = lines or ([str(exc)] if isinstance(exc, Interrupted) and str(exc) else [])
        what = "; ".join(lines) if lines else "what each dataset finished is kept in its journal"
        raise Interrupted(f"generation stopped: {what}; {RESUME}") from None
