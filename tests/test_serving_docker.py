"""The docker launcher's request and calls, as plain data:

- the request (the kwargs given to `containers.run`) is built and checked as plain data;
- the launcher's calls are checked against a small recording stand-in for the docker client, which checks
  only which requests are sent (tests/test_container_engine.py runs them against the real engine);
- the real lifecycle runs in `test_docker_lifecycle_against_a_real_engine`, in aerie's own base image
  (`make images`; nothing is pulled).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest

from aerie.errors import ServerLaunchError
from aerie.serving import DockerLauncher, ModelServer, ServerConfig, run_kwargs, spec_for
from aerie.serving.container import LABEL_OWNER, LABEL_RUN, docker_client
from tests.docker_support import BASE_IMAGE, engine, fake_container_spec, require_image
from tests.fake_servers.scenarios import free_port


def kimi_spec(tmp_path: Path, **cfg: Any):
    model = tmp_path / "Kimi-K2.5"
    model.mkdir(exist_ok=True)
    config = ServerConfig(
        backend="sglang", launcher="docker", tp_size=8, image="aerie/sglang-extract:0.5.14", port=30000, **cfg
    )
    return spec_for(
        config, model_path=str(model), mode="extract", dump_dir=tmp_path / "dumps", nonce="0123456789abcdef"
    )


def test_run_request_mirrors_sglangs_documented_docker_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    spec = kimi_spec(tmp_path, hf_cache=str(tmp_path / "hf"))
    kw = run_kwargs(spec)
    model, dumps = str((tmp_path / "Kimi-K2.5").resolve()), str((tmp_path / "dumps").resolve())

    assert kw["image"] == "aerie/sglang-extract:0.5.14" and kw["command"] == spec.command
    # Run under the tether, stdin held open by the owner's attach: the container dies with its owner.
    assert kw["entrypoint"][:2] == ["/bin/sh", "-c"] and kw["stdin_open"] and not kw["detach"] and kw["init"]
    image_entrypoint = ["python3", "-m", "aerie.sglang_plugin.launch"]
    assert run_kwargs(spec, image_entrypoint)["command"] == [*image_entrypoint, *spec.command]
    assert kw["name"] == "aerie-sglang-extract-0123456789ab"
    assert kw["labels"] == {
        LABEL_RUN: "0123456789abcdef",
        "aerie.server": "sglang-extract",
        LABEL_OWNER: f"{socket.gethostname()}:{os.getpid()}",
    }
    assert kw["ports"] == {"30000/tcp": ("127.0.0.1", 30000)}  # published on the loopback only
    assert kw["ipc_mode"] == "host" and kw["shm_size"] == "32g"
    [gpus] = kw["device_requests"]
    assert gpus["Count"] == -1 and gpus["Capabilities"] == [["gpu"]]  # --gpus all
    assert kw["volumes"] == {
        str(tmp_path / "hf"): {"bind": "/root/.cache/huggingface", "mode": "rw"},
        model: {"bind": model, "mode": "ro"},
        dumps: {"bind": dumps, "mode": "rw"},
    }
    env = kw["environment"]
    assert env["AERIE_DUMP_DIR"] == dumps and env["HF_TOKEN"] == "hf_not_a_real_token"
    assert "0.0.0.0" in env["no_proxy"]
    # The secret travels to the container only: not in the spec's repr nor its one-line description.
    assert "hf_not_a_real_token" not in repr(spec) + spec.describe()


def test_gpu_counts_in_the_request(tmp_path: Path) -> None:
    assert run_kwargs(kimi_spec(tmp_path, gpus=2))["device_requests"][0]["Count"] == 2
    assert "device_requests" not in run_kwargs(kimi_spec(tmp_path, gpus=0))
    # A CPU server asks for none, whatever server.gpus says (its default -1 would be refused by a host
    # without a GPU runtime).
    assert "device_requests" not in run_kwargs(kimi_spec(tmp_path, device="cpu"))
    assert "device_requests" in run_kwargs(kimi_spec(tmp_path, device="cuda"))


class RecordingContainer:
    def __init__(self, calls: list[tuple[str, Any]]) -> None:
        self.calls = calls
        self.name, self.short_id, self.id = "aerie-x", "abc123", "abc123full"
        self.attrs: dict[str, Any] = {"State": {"Status": "running", "ExitCode": 0}}

    def reload(self) -> None:
        self.calls.append(("reload", None))

    def logs(self, **kw: Any):
        self.calls.append(("logs", kw))
        yield b"[2026-01-01 00:00:00] Load weight begin. avail mem=70 GB\n"

    def start(self) -> None:
        self.calls.append(("start", None))

    def stop(self, timeout: int) -> None:
        self.calls.append(("stop", timeout))
        self.attrs["State"] = {"Status": "exited", "ExitCode": 0}

    def remove(self, force: bool) -> None:
        self.calls.append(("remove", force))


class RecordingClient:
    """Stand-in for `docker.DockerClient` (mock: no engine here); records the requests it receives."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.containers = self.images = self.api = self
        self.container = RecordingContainer(self.calls)
        self.attrs: dict[str, Any] = {"Config": {"Entrypoint": None}}  # the image's

    def get(self, image: str) -> RecordingClient:
        return self

    def create(self, **kw: Any) -> RecordingContainer:
        self.calls.append(("create", kw))
        return self.container

    def attach_socket(self, container_id: str, params: dict[str, Any]) -> RecordingClient:
        self.calls.append(("attach", params))
        return self

    def close(self) -> None:
        self.calls.append(("detach", None))


def test_launcher_sends_the_request_then_stops_and_removes(tmp_path: Path) -> None:
    spec = kimi_spec(tmp_path).with_(log_path=tmp_path / "server.log", grace_s=20.0)
    client = RecordingClient()
    launcher = DockerLauncher(client=client)
    launcher.start(spec)
    # Created, stdin attached, then started: no moment runs the server without its tether.
    assert client.calls[:3] == [
        ("create", run_kwargs(spec)),
        ("attach", {"stdin": 1, "stream": 1}),
        ("start", None),
    ]
    assert launcher.exit_code() is None and launcher.describe() == "container aerie-x (abc123)"
    result = launcher.stop(spec.grace_s)
    requests = [call for call in client.calls if call[0] in ("stop", "remove", "detach")]
    # SIGTERM, 20 s grace, kill; then removed, and the attach let go.
    assert requests == [("stop", 20), ("remove", True), ("detach", None)]
    assert result.exit_code == 0 and not result.killed
    assert "Load weight begin" in spec.log_path.read_text()  # logs streamed into the log file
    assert launcher.stop(spec.grace_s) is result  # idempotent


def engine_or_reason() -> str | None:
    try:
        docker_client()
    except ServerLaunchError as exc:
        return str(exc)
    return None


@pytest.mark.integration
def test_without_an_engine_the_launch_fails_before_any_wait(tmp_path: Path) -> None:
    reason = engine_or_reason()
    if reason is None:
        pytest.skip("a Docker engine is reachable here; this test is about its absence")
    spec = kimi_spec(tmp_path).with_(port=free_port(), log_path=tmp_path / "server.log")
    with pytest.raises(ServerLaunchError, match="no Docker engine reachable"):
        ModelServer(spec).start()
    assert not spec.log_path.exists()


@pytest.mark.docker
@pytest.mark.integration
def test_docker_lifecycle_against_a_real_engine(tmp_path: Path) -> None:
    client = engine()
    require_image(client, BASE_IMAGE)
    spec = fake_container_spec(tmp_path)
    with ModelServer(spec) as server:
        assert server.info["weight_version"] == spec.weight_version
        [container] = client.containers.list(filters={"label": f"{LABEL_RUN}={spec.nonce}"})
        assert container.labels[LABEL_OWNER] == f"{socket.gethostname()}:{os.getpid()}"
    assert client.containers.list(all=True, filters={"label": f"{LABEL_RUN}={spec.nonce}"}) == []
    assert "ready to roll" in spec.log_path.read_text()  # the container's logs reached the log file
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT of our requests
        probe.bind(("127.0.0.1", spec.port))  # the port is free again
