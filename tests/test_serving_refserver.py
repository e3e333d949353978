"""The reference server, launched for real through `ModelServer` (SmolLM2-135M on CPU): the command that
`spec_for` builds, the interpreter check, SGLang-format progress, health, the nonce, and teardown."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import psutil
import pytest

from aerie.serving import ModelServer, ProcessLauncher, ServerConfig, port_is_free, spec_for
from aerie.serving.launcher import live_group_members
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
