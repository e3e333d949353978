"""The docker tests' common parts: the real engine, aerie's locally built images, and a container spec of
the SGLang-like fake server (standard library only) in aerie's base image.

A docker test skips, saying why, only where no engine answers (`make docker-engine` starts one) or the
images were not built (`make images`); `make test` does both first, so there they run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aerie.errors import ServerLaunchError
from aerie.serving import ServerSpec
from aerie.serving.container import docker_client
from aerie.serving.spec import new_nonce
from tests.fake_servers.scenarios import MODULE, TESTS_DIR, fake_command, free_port

BASE_IMAGE = "aerie/base:bookworm"
WORKER_IMAGE = "aerie/worker-cpu:latest"
SGLANG_CPU_IMAGE = (
    f"aerie/sglang-cpu:{(TESTS_DIR.parent / 'envs' / 'sglang' / 'VERSION').read_text().strip()}"
)
# Mounted into the container at the same path, so the fake server's module is found as on the host.
INSIDE_TESTS = "/aerie-tests"


def engine() -> Any:
    """A client of the real engine, or a skip naming what is missing."""
    try:
        return docker_client()
    except ServerLaunchError as exc:
        pytest.skip(f"needs a Docker engine (make docker-engine): {exc}")


def require_image(client: Any, image: str) -> None:
    import docker.errors

    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        pytest.skip(f"image {image} is not built here: run `make images`")


def fake_container_spec(work: Path, *flags: str, port: int | None = None, **changes: object) -> ServerSpec:
    """The fake server in the base image, its port published on the loopback, `work/dumps` bind-mounted."""
    port = port or free_port()
    nonce = new_nonce()
    dumps = work / "dumps"
    dumps.mkdir(parents=True, exist_ok=True)
    spec = ServerSpec(
        name="fake-docker",
        command=fake_command(port, f"run-{nonce}", *flags, python="python3", host="0.0.0.0"),
        model_path="fake/model",
        host="127.0.0.1",
        port=port,
        nonce=nonce,
        log_path=work / "server.log",
        startup_timeout_s=60.0,
        image=BASE_IMAGE,
        module=MODULE,
        cwd=INSIDE_TESTS,
        dump_dir=dumps,
        grace_s=5.0,
        sweep_shm=False,
        ipc_mode=None,
        shm_size="256m",
        volumes={str(TESTS_DIR): INSIDE_TESTS, str(dumps): str(dumps)},
        read_only_volumes=frozenset({str(TESTS_DIR)}),
    )
    return spec.with_(**changes) if changes else spec


# Asked from inside a container: the API's health, within a few seconds (urllib: the image's own Python).
_HEALTH = "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=5).read()"


def api_unreachable_from(client: Any, image: str, api_url: str, *, network_mode: str) -> str | None:
    """Why a container of `image` on `network_mode` cannot reach the Prefect API at `api_url`, or None.

    A flow-run container that cannot reach the API retries inside Prefect's client until a timeout many
    minutes away; asked first, the failure says why at once."""
    import docker.errors

    try:
        client.containers.run(
            image,
            ["python3", "-c", _HEALTH, api_url],
            network_mode=network_mode,
            labels={"aerie.check": "prefect-api"},
            remove=True,
            stderr=True,
        )
    except docker.errors.ContainerError as exc:
        last = (exc.stderr or b"").decode(errors="replace").strip().splitlines()[-1:]
        return (
            f"a container of {image} on network {network_mode} cannot reach the Prefect API at {api_url} "
            f"({last[0] if last else exc}): use host networking or the bridge gateway in PREFECT_API_URL"
        )
    return None
