"""`DockerLauncher`: the server as a container (SGLang's official image plus aerie's plugin).

The request mirrors SGLang's documented `docker run`: GPUs through a device
request, `--shm-size`, `--ipc=host`, the HTTP port published on the host, the HF cache and the dump dir
mounted. The container gets a unique name and aerie's labels (`aerie.run=<nonce>`, `aerie.server`, and
`aerie.owner=<host>:<pid>` of the process that started it), so a container left by a killed pipeline is
found and removed, and only aerie's containers ever are; its logs are streamed by a thread into the same
log file the process launcher writes, and its state comes from the engine. Images are never pulled:
aerie's are built locally (`make images`), so a missing one is an error naming the build.

A container dies with its owner, however the owner ends (SIGKILL and the OOM killer included): the
engine has no parent-death setting, so the owner holds the container's stdin open through the engine's
attach stream (created with `OpenStdin` and `StdinOnce`, attached before the start), and the command
runs under a small `/bin/sh` tether (`TETHER`): when the owner's process is gone the kernel closes its
socket, the engine closes the container's stdin, and the tether sends the server SIGTERM, then SIGKILL
after `TETHER_GRACE_S`. The server runs as the tether's exec'd shell under the engine's init (`--init`),
which passes the engine's own stop signal on and exits with the server's exit code. The exited container is removed by the next launch
(`_remove_leftovers`, by its owner label). The image needs `/bin/sh` (every SGLang image has one).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from aerie.errors import ServerError, ServerLaunchError
from aerie.serving.launcher import _FIND_SPEC, Launcher, StopResult
from aerie.serving.spec import ServerSpec

log = logging.getLogger(__name__)

LABEL_RUN = "aerie.run"
LABEL_SERVER = "aerie.server"
LABEL_OWNER = "aerie.owner"
BUILD_HINT = (
    "build it with `make images` (docker/build-images.sh), or docker build -f docker/<recipe> for another"
)
TETHER_GRACE_S = 30
# The tether (see the module's docstring). fd 3 keeps the attached stdin (a background list's stdin is
# /dev/null in sh); the server is exec'd in the foreground (its signals as usual, the shell's pid, so
# `$$` names it), under the engine's init (`init=True`), which passes it the engine's stop signal.
TETHER = (
    "exec 3<&0 </dev/null\n"
    '( cat <&3 >/dev/null; echo "aerie: the process that started this container is gone: stopping the server" >&2\n'
    f"  kill -TERM $$; sleep {TETHER_GRACE_S}; kill -KILL $$ ) &\n"
    'exec "$@" 3<&-\n'
)
# Passed through from aerie's environment when set (gated models); never logged.
PASSTHROUGH_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def _sdk(module: str = "docker") -> Any:
    """The docker SDK, imported lazily (only the docker launcher needs it) and by name: the repo's own
    `docker/` folder of Dockerfiles would otherwise shadow it for the type checker."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - docker comes with prefect-docker
        raise ServerLaunchError("the docker launcher needs the `docker` package (prefect-docker)") from exc


def _errors() -> Any:
    return _sdk("docker.errors")


def container_name(spec: ServerSpec) -> str:
    safe = re.sub(r"[^a-zA-Z0-9_.-]", "-", spec.name)
    return f"aerie-{safe}-{spec.nonce[:12]}"


def container_env(spec: ServerSpec) -> dict[str, str]:
    env = {k: os.environ[k] for k in PASSTHROUGH_ENV if k in os.environ}
    env.update(spec.env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_kwargs(spec: ServerSpec, image_entrypoint: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The keyword arguments of `docker.DockerClient.containers.create` for this spec: its command
    (after the image's own entrypoint, `image_entrypoint`) run under the tether, stdin held open."""
    DeviceRequest = _sdk("docker.types").DeviceRequest

    if spec.image is None:
        raise ServerLaunchError(f"server {spec.name}: the docker launcher needs an image")
    kwargs: dict[str, Any] = {
        "image": spec.image,
        "entrypoint": ["/bin/sh", "-c", TETHER, "aerie-tether"],
        "command": [*image_entrypoint, *spec.command],
        "name": container_name(spec),
        "labels": {LABEL_RUN: spec.nonce, LABEL_SERVER: spec.name, LABEL_OWNER: owner_label()},
        # Not detached, stdin open: the engine sets StdinOnce, so the owner's attach holds it.
        "detach": False,
        "stdin_open": True,
        "init": True,
        "environment": container_env(spec),
        # The server listens on spec.port inside; publish it on the host address the spec names only.
        "ports": {f"{spec.port}/tcp": (spec.host, spec.port)},
        "volumes": {
            host: {"bind": inside, "mode": "ro" if host in spec.read_only_volumes else "rw"}
            for host, inside in spec.volumes.items()
        },
    }
    if spec.cwd:
        kwargs["working_dir"] = spec.cwd
    if spec.ipc_mode:
        kwargs["ipc_mode"] = spec.ipc_mode
    if spec.shm_size:
        # Moot with ipc_mode=host (the host's /dev/shm is used) but kept, as SGLang's docs do, so a
        # spec without host IPC still gets a large enough /dev/shm for NCCL.
        kwargs["shm_size"] = spec.shm_size
    if spec.memory_limit:
        kwargs["mem_limit"] = spec.memory_limit
        kwargs["memswap_limit"] = spec.memory_limit  # no swap beyond it: the limit is the limit
    if spec.gpus is not None and spec.gpus != 0:
        kwargs["device_requests"] = [DeviceRequest(count=spec.gpus, capabilities=[["gpu"]])]
    return kwargs


def owner_label() -> str:
    """`<host>:<pid>` of this process: a container whose owner on this host is dead is a leftover."""
    return f"{socket.gethostname()}:{os.getpid()}"


def owner_is_dead(labels: dict[str, str]) -> bool:
    """Whether the aerie process that started a container is gone (only known for this host's pids)."""
    host, _, pid = labels.get(LABEL_OWNER, "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    return not psutil.pid_exists(int(pid))


def published_ports(container: Any) -> set[int]:
    """Host ports a container publishes (from its port bindings; `--network host` publishes none)."""
    bindings = container.attrs.get("HostConfig", {}).get("PortBindings") or {}
    ports: set[int] = set()
    for binds in bindings.values():
        for bind in binds or []:
            if str(bind.get("HostPort", "")).isdigit():
                ports.add(int(bind["HostPort"]))
    return ports


def foreign_files(root: Path, uid: int, gid: int) -> bool:
    """Whether anything under `root` belongs to someone other than uid:gid."""
    for path in root.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            st = path.lstat()
            if st.st_uid != uid or st.st_gid != gid:
                return True
    return False


def refusal(exc: Exception, spec: ServerSpec) -> str:
    """The engine's refusal of a container in one line; a GPU request on an engine without a GPU runtime
    names the setting that makes it."""
    if "could not select device driver" in str(exc) and spec.gpus:
        return (
            f"the engine has no GPU runtime for the container's GPU request (server.gpus={spec.gpus}): "
            "set server.gpus=0 on a host without GPUs, or install the NVIDIA container toolkit"
        )
    return f"the engine refused the container: {exc}"


def docker_client() -> Any:
    """A client of the local engine, or a `ServerLaunchError` saying why there is none."""
    try:
        client = _sdk().from_env()
        client.ping()
    except Exception as exc:  # docker raises DockerException, requests' errors, FileNotFoundError...
        raise ServerLaunchError(f"no Docker engine reachable (DOCKER_HOST / docker.sock): {exc}") from exc
    return client


class DockerLauncher(Launcher):
    """One server container: preflight (engine, image, interpreter), run, stream logs, stop, remove."""

    host_pids = False

    def __init__(self, client: Any | None = None) -> None:
        self._client = client
        self._container: Any | None = None
        self._log_thread: threading.Thread | None = None
        self._stopped: StopResult | None = None
        self._tether: Any | None = None  # the attach socket holding the container's stdin
        self._oom = False
        self._spec: ServerSpec | None = None

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = docker_client()
        return self._client

    @property
    def container(self) -> Any | None:
        return self._container

    def preflight(self, spec: ServerSpec) -> None:
        errors = _errors()
        if spec.image is None:
            raise ServerLaunchError(f"server {spec.name}: the docker launcher needs an image")
        try:
            self.client.images.get(spec.image)
        except errors.ImageNotFound as exc:
            raise ServerLaunchError(
                f"image {spec.image} is not on this Docker engine and aerie never pulls: {BUILD_HINT}"
            ) from exc
        if spec.interpreter and spec.module:
            self._check_interpreter(spec)

    def clear_port(self, spec: ServerSpec) -> None:
        self._remove_leftovers()
        self._refuse_port_holder(spec)

    def _remove_leftovers(self) -> None:
        """Remove aerie's server containers whose owning process is dead (a killed pipeline's)."""
        errors = _errors()
        for container in self.client.containers.list(all=True, filters={"label": LABEL_SERVER}):
            if owner_is_dead(container.labels):
                log.warning(
                    "removing %s: a server container left by aerie process %s, which is gone",
                    container.name,
                    container.labels.get(LABEL_OWNER),
                )
                with contextlib.suppress(errors.NotFound):
                    container.remove(force=True)

    def _refuse_port_holder(self, spec: ServerSpec) -> None:
        """A running container that publishes the port would take this server's place: refuse, naming it."""
        for container in self.client.containers.list(filters={"status": "running"}):
            if spec.port in published_ports(container):
                whose = (
                    f"aerie's, started by {container.labels[LABEL_OWNER]}"
                    if LABEL_OWNER in container.labels
                    else "not aerie's"
                )
                raise ServerLaunchError(
                    f"server {spec.name}: port {spec.port} is published by container {container.name} "
                    f"({whose}); stop it (docker rm -f {container.name}) or set server.port"
                )

    def _check_interpreter(self, spec: ServerSpec) -> None:
        """A `No module named sglang.launch_server`, caught inside the image before the launch."""
        errors = _errors()
        assert spec.interpreter is not None and spec.module is not None and spec.image is not None
        request = run_kwargs(spec)
        try:
            self.client.containers.run(
                spec.image,
                entrypoint=[spec.interpreter],
                command=["-c", _FIND_SPEC, spec.module],
                environment=request["environment"],
                volumes=request["volumes"],  # the module may come from a mounted dir
                working_dir=request.get("working_dir"),
                labels={**request["labels"], LABEL_SERVER: f"{spec.name}-check"},
                remove=True,
                stdout=True,
                stderr=True,
            )
        except errors.ContainerError as exc:
            stderr = exc.stderr.decode(errors="replace").strip() if exc.stderr else ""
            detail = stderr.splitlines()[-1] if stderr else f"No module named {spec.module}"
            raise ServerLaunchError(
                f"image {spec.image}: interpreter {spec.interpreter} cannot import the server module "
                f"{spec.module} ({detail}). Fix server.container_python or the image."
            ) from exc
        except errors.APIError as exc:
            raise ServerLaunchError(f"image {spec.image}: cannot run {spec.interpreter}: {exc}") from exc

    def start(self, spec: ServerSpec) -> None:
        errors = _errors()
        self._spec = spec
        if self._container is not None:
            raise ServerError(f"server {spec.name} was already started ({self.describe()})")
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            entrypoint = self.client.images.get(spec.image).attrs.get("Config", {}).get("Entrypoint")
            self._container = self.client.containers.create(**run_kwargs(spec, entrypoint or ()))
            # Attached before the start: from here on the container dies with this process.
            self._tether = self.client.api.attach_socket(self._container.id, params={"stdin": 1, "stream": 1})
            self._container.start()
        except errors.APIError as exc:
            # A start the engine refused leaves a created container behind.
            self._remove_run(spec)
            raise ServerLaunchError(f"server {spec.name}: {refusal(exc, spec)}") from exc
        self._log_thread = threading.Thread(
            target=self._stream_logs, args=(spec,), name=f"logs-{container_name(spec)}", daemon=True
        )
        self._log_thread.start()
        log.info("started %s: %s (log %s)", spec.name, self.describe(), spec.log_path)

    def _remove_run(self, spec: ServerSpec) -> None:
        errors = _errors()
        for container in self.client.containers.list(
            all=True, filters={"label": f"{LABEL_RUN}={spec.nonce}"}
        ):
            with contextlib.suppress(errors.NotFound):
                container.remove(force=True)

    def _stream_logs(self, spec: ServerSpec) -> None:
        """Copy the container's stdout+stderr into the log file until the container ends."""
        assert self._container is not None
        try:
            with spec.log_path.open("ab") as out:
                for chunk in self._container.logs(stream=True, follow=True):
                    out.write(chunk)
                    out.flush()
        except Exception as exc:  # the container was removed under the stream: nothing more to copy
            log.debug("log stream of %s ended: %s", self.describe(), exc)

    def _state(self) -> dict[str, Any]:
        assert self._container is not None
        self._container.reload()
        state: dict[str, Any] = self._container.attrs.get("State", {})
        return state

    def exit_code(self) -> int | None:
        errors = _errors()
        if self._container is None:
            return None
        if self._stopped is not None:
            return self._stopped.exit_code
        try:
            state = self._state()
        except errors.NotFound:
            return -1  # removed behind our back: it is certainly not serving
        if state.get("Status") in ("exited", "dead"):
            return int(state.get("ExitCode", -1))
        return None

    def oom_killed(self) -> bool:
        if self._stopped is not None:
            return self._oom
        try:
            return bool(self._state().get("OOMKilled"))
        except Exception:
            return False

    def describe_end(self, code: int | None) -> str:
        if code is not None and self.oom_killed():
            limit = self._spec.memory_limit if self._spec is not None else None
            at = f" at its memory limit of {limit} (server.memory_limit)" if limit else ""
            return f"killed by the kernel's OOM killer{at} (exit code {code})"
        return super().describe_end(code)

    def describe(self) -> str:
        if self._container is None:
            return "no container"
        return f"container {self._container.name} ({self._container.short_id})"

    def stop(self, grace_s: float) -> StopResult:
        errors = _errors()
        if self._stopped is not None:
            return self._stopped
        if self._container is None:
            return StopResult(None, False, 0.0)
        began = time.monotonic()
        code: int | None = None
        try:
            # The engine sends SIGTERM, waits `timeout`, then SIGKILLs every process of the container.
            self._container.stop(timeout=max(1, int(round(grace_s))))
            state = self._state()
            code, self._oom = int(state.get("ExitCode", -1)), bool(state.get("OOMKilled"))
        except errors.NotFound:
            pass
        except errors.APIError as exc:
            log.warning("stopping %s failed (%s); removing it by force", self.describe(), exc)
        self._give_back_dump_files()
        with contextlib.suppress(errors.NotFound):
            self._container.remove(force=True)
        if self._log_thread is not None:
            self._log_thread.join(timeout=5)
        if self._tether is not None:
            with contextlib.suppress(OSError):
                self._tether.close()
            self._tether = None
        killed = code == 137 and grace_s > 0
        self._stopped = StopResult(code, killed, time.monotonic() - began)
        return self._stopped

    def _give_back_dump_files(self) -> None:
        """Files the server wrote as root into the bind-mounted dump dir get the dir's owner, so the
        client can delete them: one short container of the same image chowns them (only if needed)."""
        spec = self._spec
        if spec is None or spec.image is None or spec.dump_dir is None or not spec.dump_dir.is_dir():
            return
        owner = spec.dump_dir.stat()
        if not foreign_files(spec.dump_dir, owner.st_uid, owner.st_gid):
            return
        dump = str(spec.dump_dir)
        try:
            self.client.containers.run(
                spec.image,
                entrypoint=["chown", "-R", f"{owner.st_uid}:{owner.st_gid}", dump],
                command=[],
                volumes={dump: {"bind": dump, "mode": "rw"}},
                labels={
                    LABEL_SERVER: f"{spec.name}-chown",
                    LABEL_OWNER: owner_label(),
                    LABEL_RUN: spec.nonce,
                },
                remove=True,
            )
        except Exception as exc:  # teardown goes on; the message says what is left to do
            log.warning("could not give %s's files back to uid %d: %s", dump, owner.st_uid, exc)

    def shares_shm(self) -> bool:
        """Another running container with host IPC may own segments whose pids mean nothing here."""
        try:
            running = self.client.containers.list(filters={"status": "running"})
        except Exception:
            return True  # cannot tell: do not sweep
        mine = self._container.id if self._container is not None else None
        return any(c.id != mine and c.attrs.get("HostConfig", {}).get("IpcMode") == "host" for c in running)
