"""A real local webhook receiver: an HTTP server on 127.0.0.1 that records every POSTed JSON body."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class _Receiver(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.received.append(json.loads(body or b"{}"))  # type: ignore[attr-defined]
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[dict]]]:
    """Yields (url, received bodies)."""
    with receiver() as hook:
        yield hook


@contextlib.contextmanager
def receiver() -> Iterator[tuple[str, list[dict]]]:
    """The receiver, for code that is not a test (the fault matrix): (url, received bodies)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.received = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", server.received  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
