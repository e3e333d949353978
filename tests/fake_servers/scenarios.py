"""Specs that launch `sglang_like.py` for a scenario; shared by the tests and benchmarks/stages/readiness.py."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from aerie.serving.spec import ServerSpec, new_nonce

TESTS_DIR = Path(__file__).resolve().parents[1]
MODULE = "fake_servers.sglang_like"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fake_command(
    port: int, weight_version: str, *flags: str, python: str = sys.executable, host: str = "127.0.0.1"
) -> list[str]:
    return [
        python,
        "-m",
        MODULE,
        "--model-path",
        "fake/model",
        "--host",
        host,
        "--port",
        str(port),
        "--weight-version",
        weight_version,
        *flags,
    ]


def fake_spec(
    work: Path, *flags: str, port: int | None = None, startup_timeout_s: float = 60.0, **changes: object
) -> ServerSpec:
    """A spec running the fake server as `python -m fake_servers.sglang_like` (the interpreter check
    runs for real), logging to `work/server.log`, with `/dev/shm` stood in by `work/shm`."""
    port = port or free_port()
    nonce = new_nonce()
    (work / "shm").mkdir(parents=True, exist_ok=True)
    spec = ServerSpec(
        name="fake",
        command=fake_command(port, f"run-{nonce}", *flags),
        model_path="fake/model",
        host="127.0.0.1",
        port=port,
        nonce=nonce,
        log_path=work / "server.log",
        startup_timeout_s=startup_timeout_s,
        module=MODULE,
        cwd=str(TESTS_DIR),
        grace_s=5.0,
        poll_interval_s=0.2,
        sweep_shm=True,
        shm_dir=work / "shm",
    )
    return spec.with_(**changes) if changes else spec


def start_stale_server(
    port: int, log_path: Path, weight_version: str = "run-stale"
) -> subprocess.Popen[bytes]:
    """A server already answering on `port` (one a bash wait loop forgot to kill); returns once it is up."""
    proc = subprocess.Popen(
        fake_command(port, weight_version, "--shard-seconds", "0", "--warmup-seconds", "0"),
        cwd=TESTS_DIR,
        stdout=log_path.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the stale server exited with {proc.returncode}; see {log_path}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the stale server did not bind its port in 60 s")
