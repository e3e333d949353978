"""A lean HTTP/1.1 keep-alive transport for `httpx.AsyncClient`, built on asyncio protocols.

Why not httpcore's pool: it rescans every connection for every queued request (O(connections x
requests) per request), which at concurrency 256 costs ~4 ms of CPU per request — the client, not the
endpoint, becomes the limit (benchmarks/stages/generate_client.py). This transport keeps idle connections
on a stack per origin (O(1) to take or return), writes each request in one write and parses the
response in place: Content-Length, chunked and read-until-close bodies, keep-alive, TLS. It plugs in
under the same `httpx.AsyncClient`, so requests, responses, content decoding (gzip) and the error
types stay httpx's. It speaks neither HTTP/2 nor proxies: the client falls back to httpx's own
transport when a proxy applies (see `ChatClient`).

Timeouts follow httpx's request extension: `connect` bounds opening a connection (TLS included),
`read` bounds the wait for the whole response (a non-streamed completion sends nothing until it is
done, so this equals httpx's per-read timeout in practice).
"""

from __future__ import annotations

import asyncio
import select
import ssl
import time
from collections import defaultdict
from typing import Any

import httpx

MAX_HEAD_BYTES = 64 << 10
Origin = tuple[str, str, int]


class _ProtocolError(Exception):
    pass


class _Connection(asyncio.Protocol):
    """One keep-alive connection; `roundtrip()` sends a request and awaits its parsed response."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = time.monotonic()
        self._buffer = bytearray()
        self._waiter: asyncio.Future[tuple[int, bytes, list[tuple[bytes, bytes]], bytes, bool]] | None = None
        self._reset()

    def _reset(self) -> None:
        self._head: tuple[int, bytes, list[tuple[bytes, bytes]], bool] | None = None
        self._length: int | None = None  # bytes of body still expected (Content-Length framing)
        self._chunked = False
        self._until_close = False
        self._body = bytearray()

    @property
    def response_started(self) -> bool:
        """Whether any byte of the current response arrived (then a retry could repeat its effect)."""
        return self._head is not None or bool(self._buffer.strip())

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._waiter is None or self._waiter.done():
            if self._buffer.strip():
                self.close()  # bytes nobody asked for: this connection cannot be trusted any more
            return
        try:
            self._parse()
        except _ProtocolError as exc:
            self._fail(httpx.RemoteProtocolError(str(exc)))
            self.close()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost does the rest

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is None or self._waiter.done():
            return
        if self._head is not None and self._until_close:
            self._complete(keep_alive=False)
            return
        message = "the server closed the connection without sending a complete response"
        self._fail(
            httpx.RemoteProtocolError(message) if exc is None else httpx.ReadError(f"{message}: {exc}")
        )

    # request/response
    async def roundtrip(
        self, payload: bytes, timeout: float | None
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]], bytes, bool]:
        assert self.transport is not None
        if self.closed or self.transport.is_closing():
            raise httpx.RemoteProtocolError("the server closed this keep-alive connection")
        self._reset()
        waiter = self._waiter = self.loop.create_future()
        self.transport.write(payload)
        timer = self.loop.call_later(timeout, self._timed_out) if timeout is not None else None
        try:
            return await waiter
        finally:
            if timer is not None:
                timer.cancel()
            self._waiter = None
            self.idle_since = time.monotonic()

    def _timed_out(self) -> None:
        self._fail(httpx.ReadTimeout("no complete response within the read timeout"))
        self.close()

    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    def _complete(self, keep_alive: bool) -> None:
        assert self._head is not None and self._waiter is not None
        status, reason, headers, head_keep_alive = self._head
        self._waiter.set_result((status, reason, headers, bytes(self._body), keep_alive and head_keep_alive))

    def _parse(self) -> None:
        if self._head is None and not self._parse_head():
            return
        if self._chunked:
            self._parse_chunks()
        elif self._until_close:
            self._body += self._buffer
            self._buffer.clear()
        elif self._length is not None:
            take = min(self._length, len(self._buffer))
            self._body += self._buffer[:take]
            del self._buffer[:take]
            self._length -= take
            if self._length == 0:
                self._complete(keep_alive=not self._buffer)

    def _parse_head(self) -> bool:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buffer) > MAX_HEAD_BYTES:
                raise _ProtocolError("response headers larger than 64 KiB")
            return False
        lines = bytes(self._buffer[:end]).split(b"\r\n")
        del self._buffer[: end + 4]
        try:
            version, status_text, *rest = lines[0].split(b" ", 2)
            status = int(status_text)
        except ValueError as exc:
            raise _ProtocolError(f"bad status line {lines[0][:80]!r}") from exc
        if 100 <= status < 200:
            return self._parse_head() if self._buffer else False  # interim response: skip it
        headers: list[tuple[bytes, bytes]] = []
        length: int | None = None
        connection = b""
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise _ProtocolError(f"bad header line {line[:80]!r}")
            name, value = name.strip(), value.strip()
            headers.append((name, value))
            lower = name.lower()
            if lower == b"content-length":
                try:
                    length = int(value)
                except ValueError as exc:
                    raise _ProtocolError(f"bad Content-Length {value[:40]!r}") from exc
            elif lower == b"transfer-encoding" and b"chunked" in value.lower():
                self._chunked = True
            elif lower == b"connection":
                connection = value.lower()
        keep_alive = b"close" not in connection and (version == b"HTTP/1.1" or b"keep-alive" in connection)
        self._head = (status, rest[0] if rest else b"", headers, keep_alive)
        if status in (204, 304):
            self._length = 0
        elif not self._chunked:
            if length is None:
                self._until_close = True
            else:
                self._length = length
        if self._length == 0:
            self._complete(keep_alive=not self._buffer)
            return False
        return True

    def _parse_chunks(self) -> None:
        while True:
            line_end = self._buffer.find(b"\r\n")
            if line_end < 0:
                return
            size_text = bytes(self._buffer[:line_end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError as exc:
                raise _ProtocolError(f"bad chunk size {size_text[:40]!r}") from exc
            if size == 0:
                trailer_end = self._buffer.find(b"\r\n\r\n", line_end)
                if trailer_end < 0:
                    return
                del self._buffer[: trailer_end + 4]
                self._complete(keep_alive=not self._buffer)
                return
            if len(self._buffer) < line_end + 2 + size + 2:
                return
            start = line_end + 2
            self._body += self._buffer[start : start + size]
            del self._buffer[: start + size + 2]

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def reusable(self) -> bool:
        """Still open as far as the kernel knows: an idle keep-alive socket that is readable holds
        the server's FIN (or stray bytes) that the event loop has not processed yet. Sending on it
        would fail, so it is dropped instead (httpcore does the same check)."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return False
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return True
        poller = select.poll()  # not select(): it fails on descriptors above 1023
        try:
            poller.register(sock.fileno(), select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False


class Http11Transport(httpx.AsyncBaseTransport):
    """HTTP/1.1 keep-alive pool: at most `max_connections` open at once, idle ones reused newest-first
    and closed after `keepalive_expiry_s` (servers drop idle connections; reusing a dead one costs a
    retry)."""

    def __init__(
        self,
        max_connections: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        keepalive_expiry_s: float = 30.0,
    ) -> None:
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: dict[Origin, list[_Connection]] = defaultdict(list)
        self._ssl_context = ssl_context
        self._expiry = keepalive_expiry_s
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise httpx.ConnectError("the transport is closed", request=request)
        url = request.url
        origin = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        payload = self._serialize(request, await request.aread())
        async with self._slots:
            idle = self._take_idle(origin)
            conn = idle or await self._connect(request, origin, timeouts.get("connect"))
            try:
                try:
                    status, reason, headers, content, keep_alive = await conn.roundtrip(
                        payload, timeouts.get("read")
                    )
                except (httpx.RemoteProtocolError, httpx.ReadError):
                    if idle is None or conn.response_started:
                        raise
                    # A reused keep-alive connection the server closed while our request was on its
                    # way (its FIN, or its RST when our bytes reached a closed socket, had not arrived
                    # when the pool checked it), before any byte of an answer: once more on a new one.
                    conn.close()
                    conn = await self._connect(request, origin, timeouts.get("connect"))
                    status, reason, headers, content, keep_alive = await conn.roundtrip(
                        payload, timeouts.get("read")
                    )
            except httpx.TransportError as exc:
                conn.close()
                exc.request = request
                raise
            except BaseException:
                conn.close()  # cancelled mid-response: the connection's state is unknown
                raise
            if keep_alive and not conn.closed and not self._closed:
                self._idle[origin].append(conn)
            else:
                conn.close()
        return httpx.Response(
            status,
            headers=headers,
            stream=httpx.ByteStream(content),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": reason},
        )

    @staticmethod
    def _serialize(request: httpx.Request, body: bytes) -> bytes:
        head = [request.method.encode() + b" " + request.url.raw_path + b" HTTP/1.1"]
        head += [name + b": " + value for name, value in request.headers.raw]
        return b"\r\n".join(head) + b"\r\n\r\n" + body

    def _take_idle(self, origin: Origin) -> _Connection | None:
        stack = self._idle.get(origin)
        now = time.monotonic()
        while stack:
            conn = stack.pop()
            if now - conn.idle_since < self._expiry and conn.reusable():
                return conn
            conn.close()
        return None

    async def _connect(self, request: httpx.Request, origin: Origin, timeout: float | None) -> _Connection:
        scheme, host, port = origin
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if scheme == "https":
            tls = self._ssl_context or httpx.create_ssl_context()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(loop), host, port, ssl=tls, server_hostname=host if tls else None
                ),
                timeout,
            )
        except asyncio.TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out", request=request) from exc
        except (OSError, ssl.SSLError) as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}", request=request) from exc
        return conn

    async def aclose(self) -> None:
        self._closed = True
        for stack in self._idle.values():
            for conn in stack:
                conn.close()
        self._idle.clear()
