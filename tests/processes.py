"""Processes the tests and `scripts/screenshots.py` start: free ports, process groups, a Prefect server.

Free of pytest on purpose, so the screenshot script can use it too.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from aerie.serving.probe import port_is_free

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_pair() -> int:
    """A port p with p and p + 1 both free, below the kernel's ephemeral range: a fan-out's second
    server binds p + 1 long after this check, and a port inside that range can meanwhile become the
    source port of any outgoing connection (seen in CI: "port ... is bound but does not answer HTTP")."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1025, low - 12000), low - 2)
        if all(port_is_free("127.0.0.1", p) for p in (port, port + 1)):
            return port
    raise RuntimeError(f"no two consecutive free ports below {low}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process started in its own session (`start_new_session=True`), with its children."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def prefect_server(
    home: Path, *, ui: bool = False, timeout_s: float = 180, port: int | None = None
) -> Iterator[tuple[str, dict[str, str]]]:
    """`prefect server start` on `port` (else a free one) of 127.0.0.1 with its state in `home`; yields
    (base URL, the environment it runs with) once /api/health answers, and stops it on the way out."""
    port = port or free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    argv = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    if ui:
        env["PREFECT_UI_API_URL"] = f"{base}/api"
    else:
        argv.append("--no-ui")
    log_path = home / "server.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/api/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"prefect server did not start ({log_path}): {log_path.read_text()[-2000:]}"
                )
            time.sleep(0.5)
        yield base, env
    finally:
        stop(proc)
        log.close()
