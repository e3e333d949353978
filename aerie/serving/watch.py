"""`ServingWatch`: while a server serves, notice within one poll interval that it can no longer answer.

SGLang's scheduler runs in a child process. When it dies (the OOM killer, a kill -9, a C++ abort), the
HTTP process lives on: SGLang's own watchdog notices within a second, then sleeps five more for crash
diagnostics before ending the server, and requests in flight hang meanwhile. The watch sees the child
gone at its next poll (the process launcher remembers the server's vital processes, by name, once it is
ready; other children, such as the compiler processes torch.compile starts, may come and go), or
SGLang's own crash line in the log, or the main process's exit; it then reports the crash and ends the
server, so clients fail at once with the server's own last words.

A reference server whose steps keep failing (a device poisoned by an illegal memory access answers
every request with an error while its process lives on) logs that it is unhealthy and answers /health
with 503: the watch takes that line as a crash too, so its owner restarts the server instead of
sending it requests that can only fail.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from aerie.serving.launcher import Launcher
from aerie.serving.startup_log import SERVER_UNHEALTHY, SUBPROCESS_CRASHED, LogTail

# After a lost process is seen, how long to wait for SGLang's own crash line before reporting without it
# (its watchdog polls once a second).
_LOG_SETTLE_S = 0.8
# What the watch reports when the main process has exited (the server names the exit code itself).
EXITED = "exited"


class ServingWatch:
    """A daemon thread polling one ready server; `on_crash(what, detected_at)` runs once, from it."""

    def __init__(
        self,
        launcher: Launcher,
        tail: LogTail,
        tail_lock: threading.Lock,
        poll_s: float,
        vital_children: tuple[str, ...],
        on_crash: Callable[[str, float], None],
    ) -> None:
        self._launcher = launcher
        self._tail = tail
        self._lock = tail_lock
        self._poll_s = poll_s
        self._vital_children = vital_children if launcher.host_pids else ()
        self._on_crash = on_crash
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.crash_line: str | None = None
        # What the server logged since it was ready: a crash's cause is looked for there only (the tail
        # also holds start-up tracebacks SGLang logs and survives).
        self.lines_since_ready: deque[str] = deque(maxlen=200)

    def start(self) -> None:
        if self._vital_children:
            self._launcher.watch_members(self._vital_children)
        self._thread = threading.Thread(target=self._run, name="aerie-serving-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            what = self._check()
            if what is not None:
                detected_at = time.monotonic()
                if what != EXITED:
                    self._await_crash_line()
                self._on_crash(what, detected_at)
                return

    def _check(self) -> str | None:
        lost = self._launcher.lost_members() if self._vital_children else []
        if lost:
            return f"lost {', '.join(lost)}"
        if self._read_log():
            return f"logged {self.crash_line!r}"
        # A container's state is an API call: its exit shows at the next failed request instead.
        code = self._launcher.exit_code() if self._launcher.host_pids else None
        if code is not None:
            return EXITED
        return None

    def _read_log(self) -> bool:
        with self._lock:
            pieces = self._tail.read_new()
        self.note(pieces)
        return self.crash_line is not None

    def note(self, pieces: list[str]) -> None:
        """Log pieces read since the server was ready (by the watch, or by its server at the crash)."""
        self.lines_since_ready.extend(p.strip() for p in pieces if p.strip())
        for piece in pieces:
            if self.crash_line is None and (
                SUBPROCESS_CRASHED.search(piece) or SERVER_UNHEALTHY.search(piece)
            ):
                self.crash_line = piece.strip()

    def _await_crash_line(self) -> None:
        deadline = time.monotonic() + _LOG_SETTLE_S
        while not self._read_log() and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.05)
