"""aerie's HTTP/1.1 transport (aerie/generate/transport.py) against real sockets on 127.0.0.1: every
way a server may frame a response, keep-alive reuse, a server that drops idle connections, TLS."""

from __future__ import annotations

import asyncio
import datetime
import gzip
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from aerie.generate.client import ChatClient
from aerie.generate.config import EndpointConfig, SamplingParams
from aerie.generate.transport import Http11Transport
from tests.fault_server import FaultServer, answer_for

pytestmark = pytest.mark.integration  # local HTTP servers

Responder = Callable[[socket.socket, bytes], bool]  # (socket, request path) -> keep the connection open


class RawServer:
    """A socket server whose responses are raw bytes written by hand, one responder per path."""

    def __init__(self, responders: dict[bytes, Responder]) -> None:
        self.responders = responders
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                while len(buffer) < length:
                    buffer += conn.recv(65536)
                buffer = buffer[length:]
                path = head.split(b" ")[1]
                if not self.responders[path](conn, head):
                    return

    def close(self) -> None:
        self.sock.close()


def _reply(raw: bytes, keep: bool = True) -> Responder:
    def respond(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(raw)
        return keep

    return respond


def _trickle(conn: socket.socket, head: bytes) -> bool:
    body = b'{"fragmented": true}'
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    for i in range(len(raw)):
        conn.sendall(raw[i : i + 1])
        time.sleep(0.001)
    return True


GZ = gzip.compress(b'{"zipped": true}')
RESPONDERS: dict[bytes, Responder] = {
    b"/chunked": _reply(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nX-Trailer: t\r\n\r\n"
    ),
    b"/close": _reply(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nread until the server closes", keep=False
    ),
    b"/gzip": _reply(
        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s" % (len(GZ), GZ)
    ),
    b"/interim": _reply(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"),
    b"/empty": _reply(b"HTTP/1.1 204 No Content\r\n\r\n"),
    b"/garbage": _reply(b"NOT HTTP AT ALL\r\n\r\n"),
    b"/trickle": _trickle,
    b"/then-close": _reply(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nbye", keep=False),
}


@pytest.fixture
def raw_server():
    server = RawServer(RESPONDERS)
    yield server
    server.close()


async def _get(url: str, paths: list[str]) -> list[httpx.Response]:
    async with httpx.AsyncClient(transport=Http11Transport(4), timeout=5.0) as client:
        return [await client.post(url + path, content=b"{}") for path in paths]


def test_framings_and_keep_alive(raw_server: RawServer):
    paths = ["/chunked", "/gzip", "/interim", "/empty", "/trickle", "/chunked"]
    responses = asyncio.run(_get(raw_server.url, paths))
    assert [r.status_code for r in responses] == [200, 200, 200, 204, 200, 200]
    assert responses[0].text == "hello, world" and responses[5].text == "hello, world"
    assert responses[1].json() == {"zipped": True}  # httpx decoded the gzip body
    assert responses[2].text == "ok" and responses[3].content == b""
    assert responses[4].json() == {"fragmented": True}
    assert raw_server.connections == 1  # one keep-alive connection served all six


def test_close_delimited_body_and_server_side_close(raw_server: RawServer):
    responses = asyncio.run(_get(raw_server.url, ["/close", "/then-close", "/chunked"]))
    assert responses[0].text == "read until the server closes"
    assert responses[1].text == "bye" and responses[2].text == "hello, world"
    assert raw_server.connections == 3  # each close forced a fresh connection, without an error


def test_garbage_is_a_protocol_error(raw_server: RawServer):
    with pytest.raises(httpx.RemoteProtocolError, match="bad status line"):
        asyncio.run(_get(raw_server.url, ["/garbage"]))


def test_connect_error_names_the_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connection refused
        with pytest.raises(httpx.ConnectError, match=f"127.0.0.1:{port}"):
            asyncio.run(_get(f"http://127.0.0.1:{port}", ["/x"]))


def _self_signed(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert_file, key_file)
    client_ctx = ssl.create_default_context(cafile=str(cert_file))
    return server_ctx, client_ctx


@pytest.mark.parametrize("transport", ["lean", "httpcore"])
def test_chat_over_tls(tmp_path: Path, transport: str):
    server_ctx, client_ctx = _self_signed(tmp_path)
    with FaultServer().start(tls=server_ctx) as server:
        assert server.url.startswith("https://")
        endpoint = EndpointConfig(base_url=server.url, concurrency=2, http_transport=transport)  # type: ignore[arg-type]
        messages = [{"role": "user", "content": "over TLS"}]

        async def ask() -> str:
            async with ChatClient(endpoint, server.url, ssl_context=client_ctx) as client:
                return (await client.complete(messages, SamplingParams())).content

        assert asyncio.run(ask()) == answer_for(messages)
