"""The reference server, launched for real through `ModelServer` (SmolLM2-135M on CPU): the command that
`spec_for` builds, the interpreter check, SGLang-format progress, health, the nonce, and teardown."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from aerie.serving import ModelServer, ProcessLauncher, ServerConfig, port_is_free, spec_for
from aerie.serving.launcher import live_group_members
from aerie.serving.probe import port_holders
from tests.fake_servers.scenarios import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a reference server process


def refserver_available() -> bool:
    return importlib.util.find_spec("aerie.engine.__main__") is not None


@pytest.mark.skipif(not refserver_available(), reason="aerie.engine has no __main__ yet")
def test_reference_server_reaches_ready_and_goes_away(smollm2, tmp_path: Path) -> None:
    cfg = ServerConfig(port=free_port(), device="cpu", grace_s=15.0, shm_dir=str(tmp_path / "shm"))
    spec = spec_for(cfg, model_path=smollm2.path, log_path=tmp_path / "refserver.log")
    progress: list[tuple[float, str]] = []
    with ModelServer(spec, progress=lambda f, m: progress.append((f, m))) as server:
        assert server.info["weight_version"] == spec.weight_version
        assert server.health_endpoint == "/health_generate"
        launcher = server.launcher
        assert isinstance(launcher, ProcessLauncher) and launcher.pgid is not None
    messages = [m for _, m in progress]
    assert any(m.startswith("weights: shard") for m in messages), messages  # SGLang-format shard bar
    assert "fired up and ready to roll" in messages
    assert server.teardown is not None and server.teardown.port_free
    assert live_group_members(launcher.pgid) == []
    assert (
        not psutil.pid_exists(launcher.pgid) or psutil.Process(launcher.pgid).status() == psutil.STATUS_ZOMBIE
    )
    assert port_is_free("127.0.0.1", spec.port)


# The owner starts the server from a thread that ends at once (as a Prefect task's or a pool's worker
# thread would), says so, and sleeps: the server must outlive that thread, then die with the owner.
OWNER = """
import sys, threading, time
from pathlib import Path
sys.path.insert(0, {root!r})
from aerie.serving import ModelServer, ServerConfig, spec_for
cfg = ServerConfig(port={port}, device="cpu", shm_dir={shm!r})
server = ModelServer(spec_for(cfg, model_path={model!r}, log_path=Path({log!r})))
worker = threading.Thread(target=server.start)
worker.start()
worker.join()
print(server.launcher.pgid, flush=True)
time.sleep(600)
"""


def group_gone(pgid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not live_group_members(pgid):
            return True
        time.sleep(0.1)
    return not live_group_members(pgid)


@pytest.mark.skipif(not refserver_available(), reason="aerie.engine has no __main__ yet")
def test_a_server_does_not_outlive_a_sigkilled_owner(smollm2, tmp_path: Path) -> None:
    """kill -9 of the process that started a server runs no teardown; the server (in its own session,
    so no group kill reaches it) must go with its owner rather than hold its port until the next launch."""
    port = free_port()
    script = OWNER.format(
        root=str(Path(__file__).resolve().parents[1]),
        port=port,
        shm=str(tmp_path / "shm"),
        model=str(smollm2.path),
        log=str(tmp_path / "refserver.log"),
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    line = owner.stdout.readline()
    assert line.strip(), (tmp_path / "refserver.log").read_text()[-2000:]
    pgid = int(line)
    # The thread that started it has ended; the server still serves.
    assert live_group_members(pgid) and not port_is_free("127.0.0.1", port)
    owner.kill()
    assert owner.wait(timeout=60) == -signal.SIGKILL
    assert group_gone(pgid, 30.0), f"server group {pgid} still alive: {live_group_members(pgid)}"
    # The port is released as the kernel tears the process down, which may finish after the group is gone.
    deadline = time.monotonic() + 15
    while not port_is_free("127.0.0.1", port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert port_is_free("127.0.0.1", port), f"port {port} still held by {port_holders(port)}"
