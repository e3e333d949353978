"""`ServerSlot`: the one restart policy for a server its owner keeps using while it works.

Extraction (a slice's server), online training (each rank's extraction servers) and generation (its
launched endpoint) all apply the same rule: the server is started on first use; when a request on it
fails, the owner reports that failure with the slot's `generation` it used. The slot stops that server
(once, however many threads saw it fail), and the next `get()` starts a new one, until `max_restarts`
restarts are used up; then `exhausted(why)` says what is kept and the error is raised. A failure seen
on a server the slot has already replaced is not counted again.

Extraction restarts on any failed request (its requests are idempotent and a server that drops one is
suspect); generation restarts only a server that is dead (`only_if_dead`): an endpoint's single HTTP 500
is the client's to retry, but a server its watch ended (a crash, a device poisoned into failing every
step) will answer nothing again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from aerie.errors import AerieError, ServerCrashedError, ServerError
from aerie.serving.server import ModelServer

log = logging.getLogger(__name__)


class ServerSlot:
    """One server kept serving under one restart budget; thread-safe."""

    def __init__(
        self,
        start: Callable[[int], ModelServer],
        *,
        name: str,
        max_restarts: int,
        exhausted: Callable[[str], AerieError],
        say: Callable[[str], None] | None = None,
    ) -> None:
        """`start(attempt)` launches and returns a ready server (attempt counts every start, failed
        ones too); `exhausted(why)` builds the error raised once the restarts are used up."""
        self._start = start
        self.name = name
        self.max_restarts = max_restarts
        self._exhausted = exhausted
        self._say = say or (lambda message: log.warning("%s", message))
        self.lock = threading.Lock()
        self.server: ModelServer | None = None
        self.generation = 0  # bumped at every start: a failure seen on an older one is already handled
        self.starts = 0
        self.restarts = 0
        self.errors: list[str] = []
        self.state = "not started"  # not started, starting, up, restarting, failed, stopped
        self._gave_up: AerieError | None = None  # raised again to every later caller

    def get(self) -> tuple[ModelServer, int]:
        """The server (started now if there is none) and its generation. A server that dies during its
        own start-up checks after it was ready (its canary) counts as a failure and is started again."""
        with self.lock:
            while self.server is None:
                if self._gave_up is not None:
                    raise self._gave_up
                self.state = "starting"
                attempt, self.starts = self.starts, self.starts + 1
                try:
                    self.server = self._start(attempt)
                except ServerCrashedError as exc:
                    if not exc.after_ready:
                        self.state = "failed"
                        raise
                    self._count(str(exc), exc)
                    continue
                self.generation += 1
                self.state = "up"
            return self.server, self.generation

    def failed(self, generation: int, exc: Exception, *, only_if_dead: bool = False) -> bool:
        """A request on server `generation` failed. Stop it and count a restart (raising once they are
        used up), and return True: the next `get()` has a new server. With `only_if_dead`, a server
        that still lives is left serving and False returned."""
        with self.lock:
            if self._gave_up is not None:
                raise self._gave_up
            if generation != self.generation or self.server is None:
                return True  # another thread saw it first: it is already replaced
            try:
                self.server.check_alive()
                if only_if_dead:
                    return False
                why = f"{self.name} is alive but failed: {exc}"
            except ServerError as dead:
                why = str(dead)
            server, self.server = self.server, None
            server.stop()
            self._count(why, exc)
            return True

    def revive(self, generation: int, exc: Exception) -> bool:
        """For an owner that keeps one address (generation's endpoint): when server `generation` is
        dead, its successor is started now, from the same spec and so on the same port, and True is
        returned once it serves; False when it still lives."""
        if not self.failed(generation, exc, only_if_dead=True):
            return False
        self.get()
        return True

    def _count(self, why: str, exc: Exception) -> None:
        """One more failure: a restart if the budget allows, else the owner's error (holding the lock)."""
        self.errors.append(why.splitlines()[0])
        if self.restarts >= self.max_restarts:
            self.state = "failed"
            self._gave_up = self._exhausted(why)
            raise self._gave_up from exc
        self.restarts += 1
        self.state = "restarting"
        self._say(f"{self.name}: restarting ({self.restarts}/{self.max_restarts}): {why.splitlines()[0]}")

    def stop(self) -> None:
        with self.lock:
            if self.server is not None:
                self.server.stop()
                self.server = None
                self.state = "stopped"

    def record(self) -> dict[str, Any]:
        """The slot's life for a manifest."""
        return {
            "state": self.state,
            "starts": self.starts,
            "restarts": self.restarts,
            "errors": self.errors[-3:],
        }
