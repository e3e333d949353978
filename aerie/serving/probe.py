"""What answers on a port: the free-port check, health and identity probes over HTTP.

A bash wait loop takes "curl /health said 200" as "my server is up". Here the port must be free before
the launch (SGLang binds HTTP only after loading, so a stale server would otherwise answer for the
whole load), health means `/health_generate` 200, and identity means `/server_info` echoes the nonce
this launch passed as `--weight-version`.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from typing import Any

import httpx
import psutil

from aerie.errors import PortInUseError

HEALTH_PATHS = ("/health_generate", "/health")
IDENTITY_PATHS = ("/server_info", "/get_server_info", "/model_info")
DESCRIBE_PATHS = ("/server_info", "/get_server_info", "/model_info", "/v1/models")
# Identity keys worth showing when naming a server.
_NAME_KEYS = ("model_path", "served_model_name", "weight_version", "version", "port", "tp_size")


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def port_is_bindable(host: str, port: int) -> bool:
    """Whether a server could bind host:port now (SO_REUSEADDR, as uvicorn binds: TIME_WAIT is fine)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def port_accepts(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((_client_host(host), port), timeout=timeout):
            return True
    except OSError:
        return False


def port_is_free(host: str, port: int) -> bool:
    return port_is_bindable(host, port) and not port_accepts(host, port)


def port_holders(port: int) -> list[int]:
    """Pids listening on `port` (may be empty without the rights to see other users' sockets)."""
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, OSError):
        return []
    return sorted(
        {
            c.pid
            for c in conns
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
        }
    )


def _process_line(pid: int) -> str:
    try:
        proc = psutil.Process(pid)
        cmd = " ".join(proc.cmdline())[:200]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return f"pid {pid}"
    return f"pid {pid}: {cmd}"


def _identity_fields(data: Any) -> str:
    if isinstance(data, dict):
        if isinstance(data.get("data"), list) and data["data"]:  # /v1/models
            first = data["data"][0]
            return f"model id={first.get('id')!r}" if isinstance(first, dict) else ""
        picked = {k: data[k] for k in _NAME_KEYS if k in data}
        return ", ".join(f"{k}={v!r}" for k, v in picked.items())
    return ""


def describe_listener(host: str, port: int, timeout: float = 1.0) -> str:
    """Name what answers on host:port: its identity endpoint and fields, and the owning pid if visible."""
    base = f"http://{_client_host(host)}:{port}"
    parts: list[str] = []
    try:
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            for path in DESCRIBE_PATHS:
                try:
                    resp = client.get(base + path)
                except httpx.HTTPError:
                    break  # not HTTP at all (or gone): no point trying the other paths
                if resp.status_code == 200:
                    try:
                        fields = _identity_fields(resp.json())
                    except ValueError:
                        fields = ""
                    parts.append(f"GET {path} answers 200" + (f" ({fields})" if fields else ""))
                    break
            else:
                parts.append(f"an HTTP server answers, but none of {', '.join(DESCRIBE_PATHS)} gives 200")
    except httpx.HTTPError:
        pass
    if not parts:
        parts.append("the port is bound but does not answer HTTP")
    parts += [_process_line(pid) for pid in port_holders(port)]
    return "; ".join(parts)


def ensure_port_free(host: str, port: int) -> None:
    """Refuse a launch on a port that is bound or answering, naming what is there."""
    if port_is_free(host, port):
        return
    raise PortInUseError(
        f"port {port} on {host} is already in use: {describe_listener(host, port)}. A stale server would "
        f"answer the health check while the new one loads and then dies at bind ([Errno 98]). Stop it "
        f"(kill the pid above, or `docker rm -f` its container) or choose another port (server.port=...)."
    )


@dataclass(frozen=True)
class HealthResult:
    ok: bool
    status: int | None  # None: no HTTP answer (refused: still loading)
    path: str


class Prober:
    """HTTP probes of one server, remembering which fallback endpoints it turned out to have."""

    def __init__(self, url: str, connect_timeout: float = 1.0, read_timeout: float = 5.0) -> None:
        # Connecting is instant (refused while loading) or quick; answering may take a real 1-token
        # generation on a busy server, so reads get longer. A server that dies mid-request resets the
        # connection at once, so a long read does not delay crash detection.
        # trust_env=False: a proxy from the environment must not stand between us and localhost.
        timeout = httpx.Timeout(read_timeout, connect=connect_timeout)
        self._client = httpx.Client(base_url=url, timeout=timeout, trust_env=False)
        self._health_paths = list(HEALTH_PATHS)

    def close(self) -> None:
        self._client.close()

    def health(self) -> HealthResult:
        """`/health_generate`, falling back to `/health` on a server that has no such route (404)."""
        path = self._health_paths[0]
        try:
            resp = self._client.get(path)
        except httpx.HTTPError:
            return HealthResult(False, None, path)
        if resp.status_code == 404 and len(self._health_paths) > 1:
            self._health_paths.pop(0)
            return self.health()
        return HealthResult(resp.status_code == 200, resp.status_code, path)

    def identity(self) -> tuple[str, dict[str, Any]] | None:
        """The first identity endpoint that answers with a JSON object holding `weight_version`."""
        for path in IDENTITY_PATHS:
            try:
                resp = self._client.get(path)
                data = resp.json() if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                continue
            if isinstance(data, dict) and "weight_version" in data:
                return path, data
        return None
