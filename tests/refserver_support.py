"""Start the reference server as a real process for tests, and read its log."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RefServer:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def launch(model_path: str, tmp: Path, *args: str) -> RefServer:
    """Start `python -m aerie.engine` on a free port, stdout+stderr to a log file (no waiting)."""
    port = free_port()
    log_path = tmp / f"refserver-{port}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "aerie.engine", "--model-path", model_path, "--port", str(port), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    return RefServer(proc, port, log_path)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_ready(server: RefServer, timeout: float = 180.0) -> None:
    """Wait for /health_generate 200; fail with the log if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"refserver exited with {server.proc.returncode}:\n{server.log()[-3000:]}")
        try:
            if httpx.get(server.url + "/health_generate", timeout=30).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"refserver not ready after {timeout} s:\n{server.log()[-3000:]}")
