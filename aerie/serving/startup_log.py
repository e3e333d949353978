"""Turn a starting server's log into progress and fatal errors, reading the file as it grows.

SGLang (and aerie's reference server, which copies its format) prints startup stages as log lines
and tqdm bars that redraw with `\\r` (SGLang's startup log). `LogTail` reads the new bytes of the log
file and splits them on both `\\r` and `\\n`; `StartupLog` maps each piece to a fraction of the start,
so a 40-minute load of a 1T-parameter model shows where it is instead of "Waiting... 600s".
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

# Weights of the stages in the whole start (their share of a typical start):
# shards 5-80 %, KV cache 85 %, CUDA graphs 86-95 %, HTTP up 97 %, fired up 99 % (100 % is reserved
# for the moment aerie has verified health and identity).
_SHARDS = re.compile(
    r"(?P<desc>Loading safetensors checkpoint shards|Multi-thread loading shards|Loading pt checkpoint shards)"
    r":\s*(?P<pct>\d{1,3})% Completed \| (?P<n>\d+)/(?P<total>\d+)"
)
_GRAPH_BAR = re.compile(r"Capturing batches \(.*?\):\s*(?P<pct>\d{1,3})%")
_STAGES: list[tuple[re.Pattern[str], float, str]] = [
    # SGLang 0.5.23 logs `server_args={...}` (a dict); older releases `server_args=ServerArgs(...)`.
    (re.compile(r"server_args=(?:ServerArgs\(|\{)"), 0.01, "parsed server arguments"),
    (re.compile(r"Init (parallel|torch distributed) begin"), 0.02, "initialising distributed"),
    (re.compile(r"Load weight begin"), 0.05, "loading weights"),
    (re.compile(r"Load weight end"), 0.80, "weights loaded"),
    (re.compile(r"KV Cache is allocated"), 0.85, "KV cache allocated"),
    (re.compile(r"Memory pool end"), 0.86, "memory pool ready"),
    (re.compile(r"Capture .*cuda graph begin", re.IGNORECASE), 0.86, "capturing CUDA graphs"),
    (re.compile(r"Capture .*cuda graph end", re.IGNORECASE), 0.95, "CUDA graphs captured"),
    (re.compile(r"max_total_num_tokens="), 0.95, "scheduler ready"),
    (re.compile(r"Application startup complete"), 0.96, "HTTP application started"),
    (re.compile(r"Uvicorn running on"), 0.97, "HTTP server listening, warming up"),
    (re.compile(r"The server is fired up and ready to roll!"), 0.99, "fired up and ready to roll"),
]
# SGLang's subprocess watchdog (once a second): a scheduler or detokenizer died; SGLang ends itself after
# its crash diagnostics (some seconds later).
SUBPROCESS_CRASHED = re.compile(r"Subprocess \S+ \(pid=\d+\) crashed with exit code")
# The reference server's line once its steps keep failing (aerie.engine.server.scheduler.UNHEALTHY_LINE):
# it stays up but serves nothing, so a watch ends it as it would a crashed one.
SERVER_UNHEALTHY = re.compile(r"The reference server is unhealthy")
# Lines after which SGLang kills itself (§2.1, §6): seen = the start has failed, whatever /health says.
FATAL_PATTERNS = [
    re.compile(r"Initialization failed"),
    re.compile(r"died during initialization"),
    re.compile(r"\[Errno 98\]"),
    re.compile(r"address already in use", re.IGNORECASE),
    SUBPROCESS_CRASHED,
]
# The last line of a Python traceback names the error ("RuntimeError: CUDA out of memory").
_EXCEPTION_LINE = re.compile(r"^\s*(?:\[[^\]]*\]\s*)?[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b.*")


@dataclass(frozen=True)
class ProgressEvent:
    fraction: float
    message: str


class StartupLog:
    """Folds log pieces into the furthest startup stage reached, never going backwards.

    (With EAGLE-3 the drafter prints a second `Load weight begin/end` pair after the target's; the
    monotone fraction keeps the bar from jumping back.)
    """

    def __init__(self) -> None:
        self.fraction = 0.0
        self.message = "launching"
        self.fatal: str | None = None

    def feed(self, piece: str) -> ProgressEvent | None:
        """One `\\r`/`\\n`-separated piece of the log -> a progress event if it moved the start on."""
        text = piece.strip()
        if not text:
            return None
        if self.fatal is None and any(p.search(text) for p in FATAL_PATTERNS):
            self.fatal = text
        found = self._match(text)
        if found is None:
            return None
        fraction, message = found
        if fraction < self.fraction:
            return None
        changed = fraction > self.fraction or message != self.message
        self.fraction, self.message = fraction, message
        return ProgressEvent(fraction, message) if changed else None

    @staticmethod
    def _match(text: str) -> tuple[float, str] | None:
        shards = _SHARDS.search(text)
        if shards:
            pct = min(int(shards["pct"]), 100) / 100
            return 0.05 + 0.75 * pct, f"weights: shard {shards['n']}/{shards['total']} ({shards['pct']}%)"
        graph = _GRAPH_BAR.search(text)
        if graph:
            pct = min(int(graph["pct"]), 100) / 100
            return 0.86 + 0.09 * pct, f"capturing CUDA graphs ({graph['pct']}%)"
        for pattern, fraction, message in _STAGES:
            if pattern.search(text):
                return fraction, message
        return None


def error_summary(lines: list[str]) -> str | None:
    """The server's own words for why it failed: a fatal SGLang line, else the last exception line."""
    for line in reversed(lines):
        if any(p.search(line) for p in FATAL_PATTERNS):
            return line.strip()
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line) and ":" in line:
            return line.strip()
    return None


class LogTail:
    """Reads a growing log file incrementally; keeps the last lines for error messages.

    A tqdm redraw (`\\r`) replaces the current line in the kept tail instead of adding one, so the
    tail shows "78% | 50/64" once, not fifty times.
    """

    def __init__(self, path: Path, keep: int = 40, chunk: int = 1 << 20) -> None:
        self.path = path
        self._offset = 0
        self._partial = ""
        self._bar = ""  # the unfinished line as last drawn (kept tail)
        self._pending = ""  # the unfinished line's last piece already handed out
        self._emitted = 0  # complete `\r` pieces of the unfinished line already handed out
        self._chunk = chunk
        self._lines: deque[str] = deque(maxlen=keep)

    def seek_end(self) -> None:
        """Skip what the file holds now (an earlier run's output in a reused log file)."""
        try:
            self._offset = self.path.stat().st_size
        except FileNotFoundError:
            self._offset = 0
        self._partial = self._bar = self._pending = ""
        self._emitted = 0
        self._lines.clear()

    def _read_bytes(self) -> bytes:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read(self._chunk)
        except FileNotFoundError:
            return b""
        self._offset += len(data)
        return data

    def read_new(self) -> list[str]:
        """Pieces completed since the last call (split on `\r` and `\n`), in order."""
        pieces: list[str] = []
        while data := self._read_bytes():
            pieces += self._split(data.decode("utf-8", errors="replace"))
            if len(data) < self._chunk:
                break
        return pieces

    def _split(self, new_text: str) -> list[str]:
        pieces: list[str] = []
        *lines, self._partial = (self._partial + new_text).split("\n")
        for line in lines:
            segments = [s for s in line.split("\r") if s.strip()]
            pieces += self._unseen(segments)
            if segments:
                self._lines.append(segments[-1].rstrip())
            self._emitted, self._pending, self._bar = 0, "", ""
        # The unfinished line. tqdm draws "\r<bar>", so a stalled bar never gets its terminator: its
        # `\r`-ended redraws are complete, and the text after the last `\r` is the bar as last drawn
        # (possibly cut mid-write; a cut piece matches no pattern and is fed again once complete).
        *done_raw, tail = self._partial.split("\r")
        done = [s for s in done_raw if s.strip()]
        pieces += self._unseen(done)
        self._emitted = len(done)
        if tail.strip() and tail != self._pending:
            pieces.append(tail)
            self._pending = tail
        self._bar = tail.rstrip() if tail.strip() else (done[-1].rstrip() if done else "")
        return pieces

    def _unseen(self, segments: list[str]) -> list[str]:
        """Pieces of the unfinished line not handed out yet (the pending one may have been, whole)."""
        new = segments[self._emitted :]
        return new[1:] if new and new[0] == self._pending else new

    def drain(self) -> list[str]:
        """Everything left; the unfinished last line joins the kept tail (the process has exited)."""
        pieces = self.read_new()
        if self._bar:
            self._lines.append(self._bar)
        self._partial = self._pending = self._bar = ""
        self._emitted = 0
        return pieces

    def last_lines(self, n: int = 20) -> list[str]:
        lines = list(self._lines) + ([self._bar] if self._bar else [])
        return lines[-n:]


def format_tail(lines: list[str]) -> str:
    if not lines:
        return "  (the log is empty)"
    return "\n".join(f"  | {line}" for line in lines)
