"""The docker launcher against the real engine: what a container launch refuses, how a container's end
is reported, and what teardown leaves (nothing of aerie's; files the client can delete).

Every container here runs the SGLang-like fake server (standard library only) in aerie's base image,
built locally by `make images`; nothing is pulled.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aerie.errors import ServerCrashedError, ServerLaunchError
from aerie.serving import DockerLauncher, ModelServer
from aerie.serving.container import LABEL_OWNER, LABEL_RUN, LABEL_SERVER
from tests.docker_support import BASE_IMAGE, engine, fake_container_spec, require_image
from tests.fake_servers.scenarios import free_port

pytestmark = [pytest.mark.docker, pytest.mark.integration]


@pytest.fixture(scope="module")
def client() -> Any:
    found = engine()
    require_image(found, BASE_IMAGE)
    return found


@pytest.fixture
def foreign(client: Any) -> Iterator[list[Any]]:
    """Containers a test starts itself (not through aerie); removed after the test."""
    made: list[Any] = []
    yield made
    import docker.errors

    for container in made:
        with contextlib.suppress(docker.errors.NotFound):  # aerie may have removed it (a leftover)
            container.remove(force=True)


def mine(client: Any, nonce: str) -> list[Any]:
    return client.containers.list(all=True, filters={"label": f"{LABEL_RUN}={nonce}"})


def test_an_image_not_built_is_refused_naming_the_build_and_nothing_is_pulled(
    client: Any, tmp_path: Path
) -> None:
    spec = fake_container_spec(tmp_path, image="aerie/never-built:0")
    with pytest.raises(
        ServerLaunchError, match=r"aerie/never-built:0 is not on this Docker engine.*make images"
    ):
        ModelServer(spec).start()
    assert client.images.list(name="aerie/never-built") == [] and mine(client, spec.nonce) == []


def test_a_port_published_by_a_foreign_container_is_refused_naming_it(
    client: Any, tmp_path: Path, foreign: list[Any]
) -> None:
    port = free_port()
    holder = client.containers.run(
        BASE_IMAGE, ["sleep", "300"], detach=True, ports={f"{port}/tcp": ("127.0.0.1", port)}
    )
    foreign.append(holder)
    spec = fake_container_spec(tmp_path, port=port)
    with pytest.raises(ServerLaunchError) as info:
        ModelServer(spec).start()
    assert f"port {port} is published by container {holder.name} (not aerie's)" in str(info.value)
    assert mine(client, spec.nonce) == [] and not spec.log_path.exists()


def test_a_container_left_by_a_dead_pipeline_is_found_by_label_and_removed(
    client: Any, tmp_path: Path, foreign: list[Any]
) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is certainly not running any more
    port = free_port()
    left = client.containers.run(
        BASE_IMAGE,
        ["sleep", "300"],
        detach=True,
        ports={f"{port}/tcp": ("127.0.0.1", port)},
        labels={LABEL_SERVER: "sglang-extract", LABEL_OWNER: f"{socket.gethostname()}:{gone.pid}"},
    )
    foreign.append(left)
    alive = client.containers.run(
        BASE_IMAGE,
        ["sleep", "300"],
        detach=True,
        labels={LABEL_SERVER: "sglang-extract", LABEL_OWNER: f"{socket.gethostname()}:{os.getpid()}"},
    )
    foreign.append(alive)
    # The leftover held the very port this launch wants: once it is removed the launch goes ahead.
    with ModelServer(fake_container_spec(tmp_path, port=port)) as server:
        assert server.info["weight_version"] == server.spec.weight_version
    names = {c.name for c in client.containers.list(all=True, filters={"label": LABEL_SERVER})}
    assert left.name not in names and alive.name in names  # a live owner's container is not touched


def test_docker_kill_is_seen_within_2_s_with_the_exit_code_and_the_last_log_lines(
    client: Any, tmp_path: Path
) -> None:
    spec = fake_container_spec(tmp_path, "--warmup-seconds", "0", "--shard-seconds", "0")
    launcher = DockerLauncher()
    with ModelServer(spec, launcher=launcher) as server:
        assert launcher.container is not None
        client.containers.get(launcher.container.id).kill()
        killed = time.monotonic()
        while launcher.exit_code() is None and time.monotonic() - killed < 10:
            time.sleep(0.05)
        seen_after = time.monotonic() - killed
        with pytest.raises(ServerCrashedError) as info:
            server.check_alive()
    assert seen_after < 2.0, f"the kill was seen {seen_after:.2f} s after it"
    message = str(info.value)
    assert "exited while serving: killed by SIGKILL (exit code 137)" in message
    assert "ready" in message.split("last lines of", 1)[1].lower()  # the server's own last lines
    assert mine(client, spec.nonce) == []


def test_an_oom_kill_at_the_memory_limit_is_reported_as_one(client: Any, tmp_path: Path) -> None:
    spec = fake_container_spec(
        tmp_path,
        command=[
            "python3",
            "-c",
            "import time; print('loading', flush=True); x = bytearray(1 << 30); time.sleep(60)",
        ],
        module=None,
        memory_limit="64m",
    )
    with pytest.raises(ServerCrashedError) as info:
        ModelServer(spec).start()
    assert "killed by the kernel's OOM killer at its memory limit of 64m (server.memory_limit)" in str(
        info.value
    )
    assert mine(client, spec.nonce) == []


def test_dump_files_written_as_root_inside_are_the_dump_dirs_owners_after_teardown(
    client: Any, tmp_path: Path
) -> None:
    spec = fake_container_spec(tmp_path)
    dumps = spec.dump_dir
    assert dumps is not None
    os.chown(dumps, 4321, 4321)  # the dump dir of a user who is not root
    spec = spec.with_(command=[*spec.command, "--pid-file", str(dumps / "server.pid")])
    launcher = DockerLauncher()
    with ModelServer(spec, launcher=launcher):
        written = dumps / "server.pid"
        assert written.exists() and written.stat().st_uid == 0  # root inside wrote it
        container = client.containers.get(launcher.container.id)
        shm = container.exec_run(["df", "-m", "/dev/shm"]).output.decode()
    assert [(p.stat().st_uid, p.stat().st_gid) for p in dumps.rglob("*")] == [(4321, 4321)]
    assert " 256 " in shm  # /dev/shm sized as asked
    assert mine(client, spec.nonce) == []


def test_a_gpu_request_on_an_engine_without_a_gpu_runtime_names_server_gpus_and_leaves_nothing(
    client: Any, tmp_path: Path
) -> None:
    if "nvidia" in (client.info().get("Runtimes") or {}):
        pytest.skip("this engine has the NVIDIA runtime: a GPU request is granted here")
    spec = fake_container_spec(tmp_path, gpus=-1)
    with pytest.raises(ServerLaunchError, match=r"no GPU runtime .*\(server.gpus=-1\): set server.gpus=0"):
        ModelServer(spec).start()
    assert mine(client, spec.nonce) == []  # the container the engine created but would not start is gone


OWNER = """
import sys, time
from pathlib import Path
from aerie.serving import DockerLauncher, ModelServer
from tests.docker_support import fake_container_spec

launcher = DockerLauncher()
server = ModelServer(fake_container_spec(Path(sys.argv[1]), "--warmup-seconds", "0"), launcher=launcher)
server.start()
print(launcher.container.id, server.spec.port, flush=True)
time.sleep(600)
"""


def test_a_container_dies_with_its_owner_killed_by_sigkill(client: Any, tmp_path: Path) -> None:
    """The owner is a real process that starts the server and is then SIGKILLed: it runs no cleanup,
    and the engine's attach stream closing is all that tells the container."""
    root = Path(__file__).resolve().parent.parent
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        container_id, port = owner.stdout.readline().split()
        container = client.containers.get(container_id)
        assert container.status == "running"
        time.sleep(1.0)  # still running while its owner lives
        container.reload()
        assert container.status == "running"
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 60
        while container.status == "running" and time.monotonic() < deadline:
            time.sleep(0.2)
            container.reload()
        assert container.status == "exited", f"still {container.status} after its owner died"
        logs = container.logs().decode(errors="replace")
        assert "the process that started this container is gone: stopping the server" in logs
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", int(port))) != 0  # nothing serves the port any more
    finally:
        owner.kill()
        import docker.errors

        with contextlib.suppress(docker.errors.NotFound, NameError):
            container.remove(force=True)
