"""A real OpenAI-compatible `/v1/chat/completions` server on 127.0.0.1 that injects faults on demand.

Every answer is a deterministic function of the request's messages (`answer_for`), so a test can
recompute the whole regenerated conversation and check that each turn saw the right history. A fault
plan maps a prompt (the last user message) to the faults its successive requests get, then normal
answers: 429 with Retry-After (seconds or an HTTP date), 5xx bursts, answers slower than the client's
read timeout, malformed JSON, an empty `choices`, an in-band provider error, a dropped connection, any
status (401, 400, 404), a redirect, or a 200 that is not JSON (an HTML page, an SSE stream). A GET
(`/v1/models`, the check before generation) answers the model list, 401 without the key, `get_status`
or `get_fault`. It runs in a thread of the test process
(`with FaultServer() as server:`) or standalone (`python tests/fault_server.py --port 8123 --delay 0.2`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Fault:
    """What one request gets. The default is a normal answer."""

    status: int = 200
    retry_after: str | None = None
    delay_s: float = 0.0
    raw_body: bytes | None = None  # sent verbatim (malformed JSON, a provider's error object)
    empty_choices: bool = False
    drop: bool = False  # close the connection without answering
    content: str | None = None  # a normal answer with this visible text instead (an empty answer: "")
    reasoning: str | None = None  # ... and this `reasoning_content`
    finish_reason: str | None = None  # ... and this finish_reason
    unpriced: bool = False  # ... without a cost in its usage, even when the server prices answers
    content_type: str = "application/json"  # what the answer says it is (an HTML page, an SSE stream)
    location: str | None = None  # a Location header (a redirect)


OK = Fault()


def status(code: int, retry_after: str | None = None, body: str = "") -> Fault:
    return Fault(status=code, retry_after=retry_after, raw_body=body.encode() or None)


def slow(seconds: float) -> Fault:
    return Fault(delay_s=seconds)


MALFORMED = Fault(raw_body=b'{"choices": [{"message": {"content": "cut of')
EMPTY_CHOICES = Fault(empty_choices=True)
IN_BAND_ERROR = Fault(raw_body=b'{"error": {"code": 502, "message": "provider returned error"}}')
DROP = Fault(drop=True)
# A thinking model that spent max_tokens reasoning: no final answer at all.
REASONING_ONLY = Fault(content="", reasoning="Let me think step by step about this", finish_reason="length")
BLANK_ANSWER = Fault(content=" \n\t ")


def answer_for(messages: list[dict[str, Any]]) -> str:
    """The deterministic answer to a history: names the turn, echoes the question, hashes the history."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:10]
    return f"A{len(users)}: {users[-1]} #{digest}"


@dataclass
class Seen:
    """One request as the server saw it."""

    prompt: str
    at: float
    fault: Fault
    authorization: str | None
    body: dict[str, Any]


@dataclass
class FaultServer:
    plan: dict[str, list[Fault]] = field(default_factory=dict)
    default: Fault = OK  # what a request gets once its plan is used up (or has none)
    delay_s: float = 0.0  # added to every normal answer
    api_key: str | None = None  # when set, a request without `Bearer <api_key>` gets 401
    cost: float | None = None  # per-request cost reported in usage (OpenRouter style)
    reasoning: bool = False  # answer with `reasoning_content` as a thinking model does
    get_status: int = 200  # what a GET (`/v1/models`, the endpoint check before generation) gets
    get_fault: Fault | None = None  # ... or this answer (its status, raw body, content type, Location)
    seen: list[Seen] = field(default_factory=list)
    gets: list[Seen] = field(default_factory=list)  # the GETs received (prompt = the path)
    answered: Counter[str] = field(default_factory=Counter)  # prompt -> normal answers sent

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._scheme = "http"
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._httpd is not None
        return f"{self._scheme}://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def start(self, port: int = 0, tls: ssl.SSLContext | None = None, host: str = "127.0.0.1") -> FaultServer:
        """Serve on `host` (0.0.0.0: every address, loopback and network) and `port` (0 = any free one);
        with `tls`, serve HTTPS. `url` is always the loopback one."""
        handler = type("Handler", (_Handler,), {"server_state": self})
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        if tls is not None:
            self._httpd.socket = tls.wrap_socket(self._httpd.socket, server_side=True)
            self._scheme = "https"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()

    def __enter__(self) -> FaultServer:
        return self if self._httpd is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def next_fault(self, prompt: str) -> Fault:
        with self._lock:
            queue = self.plan.get(prompt)
            return queue.pop(0) if queue else self.default

    def record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)

    def requests_for(self, prompt: str) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.prompt == prompt]

    def completion(self, body: dict[str, Any], fault: Fault = OK) -> dict[str, Any]:
        messages = body["messages"]
        content = answer_for(messages) if fault.content is None else fault.content
        prompt = messages[-1]["content"]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            message["reasoning_content"] = f"thinking about {prompt}"
        if fault.reasoning is not None:
            message["reasoning_content"] = fault.reasoning
        finish = fault.finish_reason or ("length" if "[long]" in prompt else "stop")
        usage: dict[str, Any] = {
            "prompt_tokens": sum(len(m["content"].split()) for m in messages),
            "completion_tokens": len(content.split()),
        }
        if self.cost is not None and not fault.unpriced:
            usage["cost"] = self.cost
        return {
            "id": "chatcmpl-fault",
            "object": "chat.completion",
            "model": body.get("model", "fault-model"),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish,
                }
            ],
            "usage": usage,
        }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a real API server
    server_state: FaultServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet test output
        pass

    def do_GET(self) -> None:
        """`/v1/models` (any GET): the model list, 401 without the key, or `get_status`."""
        state = self.server_state
        auth = self.headers.get("Authorization")
        if state.api_key is not None and auth != f"Bearer {state.api_key}":
            code, body = 401, {"error": {"message": f"Incorrect API key provided: {auth}"}}
        elif state.get_status != 200:
            code, body = state.get_status, {"error": {"message": f"injected HTTP {state.get_status}"}}
        else:
            code, body = 200, {"object": "list", "data": [{"id": "fault-model", "object": "model"}]}
        fault = state.get_fault if state.get_fault is not None and code != 401 else status(code)
        with state._lock:
            state.gets.append(Seen(self.path, time.monotonic(), fault, auth, {}))
        payload = fault.raw_body if fault.raw_body is not None else json.dumps(body).encode()
        self._answer(fault, payload)

    def _answer(self, fault: Fault, payload: bytes) -> None:
        self.send_response(fault.status)
        self.send_header("Content-Type", fault.content_type)
        self.send_header("Content-Length", str(len(payload)))
        if fault.retry_after is not None:
            self.send_header("Retry-After", fault.retry_after)
        if fault.location is not None:
            self.send_header("Location", fault.location)
        self.end_headers()
        self.wfile.write(payload)

    def do_POST(self) -> None:
        state = self.server_state
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        prompt = body["messages"][-1]["content"] if body.get("messages") else ""
        auth = self.headers.get("Authorization")
        if state.api_key is not None and auth != f"Bearer {state.api_key}":
            # Echo the key as some providers do: the client must scrub it from its messages.
            fault = status(
                401, body=json.dumps({"error": {"message": f"Incorrect API key provided: {auth}"}})
            )
        else:
            fault = state.next_fault(prompt)
        state.record(Seen(prompt=prompt, at=time.monotonic(), fault=fault, authorization=auth, body=body))
        if fault.drop:
            self.close_connection = True
            self.connection.close()
            return
        delay = fault.delay_s + (state.delay_s if fault == OK or fault.delay_s else 0.0)
        if delay:
            time.sleep(delay)
        if fault.raw_body is not None:
            payload = fault.raw_body
        elif fault.status != 200:
            payload = json.dumps({"error": {"message": f"injected HTTP {fault.status}"}}).encode()
        elif fault.empty_choices:
            payload = json.dumps({"id": "x", "choices": [], "usage": {}}).encode()
        else:
            payload = json.dumps(state.completion(body, fault)).encode()
            if fault.content is None:
                with state._lock:
                    state.answered[prompt] += 1
        # A client that gave up (read timeout) is exactly the case being tested.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._answer(fault, payload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    server = FaultServer(delay_s=args.delay).start(args.port)
    print(f"serving {server.url}", flush=True)
    try:
        threading.Event().wait()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
