"""Launchers: start a server described by a `ServerSpec`, watch it, stop it. `ProcessLauncher` lives here;
`aerie.serving.container.DockerLauncher` implements the same interface for containers.

Both write the server's stdout and stderr to `spec.log_path`, so readiness reads one file either way.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import IO, Any

import psutil

from aerie.errors import ServerError, ServerLaunchError
from aerie.serving.spec import Requirement, ServerSpec

log = logging.getLogger(__name__)

# Run by the server's own interpreter before the launch: can it find the server module?
# (`python -c` puts the cwd first on sys.path exactly as `python -m` does.)
_FIND_SPEC = (
    "import importlib.util, sys\n"
    "try:\n"
    "    found = importlib.util.find_spec(sys.argv[1]) is not None\n"
    "except Exception as exc:\n"
    "    print(f'{type(exc).__name__}: {exc}', file=sys.stderr)\n"
    "    sys.exit(2)\n"
    "print(sys.executable)\n"
    "sys.exit(0 if found else 1)\n"
)

# Run by the server's own interpreter: the installed version of a distribution ("-" for none).
_VERSION_OF = (
    "import sys\n"
    "from importlib import metadata\n"
    "try:\n"
    "    print(metadata.version(sys.argv[1]))\n"
    "except metadata.PackageNotFoundError:\n"
    "    print('-')\n"
)


@dataclass(frozen=True)
class StopResult:
    """How a server went down: its exit code and whether it had to be killed."""

    exit_code: int | None
    killed: bool
    seconds: float


def describe_exit(code: int | None) -> str:
    """`-9` -> "killed by SIGKILL (exit code -9)"; docker's 128+n reads the same way."""
    if code is None:
        return "still running"
    signum = -code if code < 0 else (code - 128 if 128 < code < 160 else None)
    if signum is not None:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return f"killed by {name} (exit code {code})"
    return f"exit code {code}"


class Launcher(ABC):
    """One server's life: preflight (refuse before any wait), start, watch, stop.

    A launcher instance drives one launch; `ModelServer` makes one from the spec unless given one.
    """

    #: Whether the server's pids are pids of this host (a container has its own pid namespace, so the
    #: pid embedded in a `/dev/shm` segment name means nothing here).
    host_pids: bool = True

    @abstractmethod
    def preflight(self, spec: ServerSpec) -> None:
        """Raise `ServerLaunchError` if this launch cannot work (wrong interpreter, no engine...)."""

    @abstractmethod
    def start(self, spec: ServerSpec) -> None:
        """Start the server with its output going to `spec.log_path`; return at once."""

    @abstractmethod
    def exit_code(self) -> int | None:
        """None while the server runs; its exit code once it has exited."""

    def is_alive(self) -> bool:
        return self.exit_code() is None

    @abstractmethod
    def stop(self, grace_s: float) -> StopResult:
        """SIGTERM, `grace_s` to exit, then kill everything the server started. Idempotent."""

    @abstractmethod
    def describe(self) -> str:
        """Which process or container this is, for messages ("pid 123 (pgid 123)")."""

    def shares_shm(self) -> bool:
        """Whether another server may be using the same `/dev/shm` right now (blocks a sweep)."""
        return False

    def clear_port(self, spec: ServerSpec) -> None:
        """Before the port check: end this launcher's own leftovers, refuse a holder it can name.
        A process launcher has neither (its orphans are ended by `ModelServer`)."""
        return None

    def describe_end(self, code: int | None) -> str:
        """How the server ended, for messages; a container also knows whether the OOM killer did it."""
        return describe_exit(code)

    def watch_members(self, vital: tuple[str, ...]) -> None:
        """Remember the processes the server runs now (once it is ready) whose names start with one of
        `vital`, for `lost_members`."""
        return None

    def lost_members(self) -> list[str]:
        """The remembered processes that have died since, described ("pid 12 (sglang::scheduler)")."""
        return []

    def kill(self) -> None:
        """End the server at once (a server that lost a vital process); `stop` still tears down."""
        return None


def _resolve_executable(program: str, env: dict[str, str]) -> str | None:
    if os.sep in program:
        return program if os.path.isfile(program) and os.access(program, os.X_OK) else None
    return shutil.which(program, path=env.get("PATH"))


def check_interpreter(
    python: str,
    module: str,
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    timeout: float = 120,
) -> str:
    """Prove that `python` exists and can import `module`; return the interpreter's sys.executable.

    A bash wait loop that launched `/usr/bin/python3 -m sglang.launch_server` died at once with
    `No module named sglang.launch_server` while its wait loop polled on for minutes. Here that is a
    `ServerLaunchError` before any wait, naming the interpreter and the module.
    """
    full_env = {**os.environ, **(env or {})}
    exe = _resolve_executable(python, full_env)
    if exe is None:
        raise ServerLaunchError(
            f"interpreter {python!r} not found (not an executable path, not on PATH); it was to run "
            f"`-m {module}`. Set server.python to the interpreter of the environment that has {module}."
        )
    done = _probe(exe, _FIND_SPEC, module, env=full_env, cwd=cwd, timeout=timeout, doing=f"look up {module}")
    if done.returncode == 0:
        return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else exe
    detail = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"No module named {module}"
    raise ServerLaunchError(
        f"interpreter {exe} cannot import the server module {module} ({detail}); the server would die at "
        f"once with `{exe}: No module named {module}`. Set server.python to the interpreter of the "
        f"environment where {module} is installed."
    )


def _probe(
    exe: str,
    script: str,
    arg: str,
    *,
    env: dict[str, str],
    timeout: float,
    doing: str,
    cwd: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """`exe -c script arg`, its output captured; an interpreter that hangs or cannot be run is a
    ServerLaunchError saying what it was asked to do."""
    try:
        return subprocess.run(
            [exe, "-c", script, arg],
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ServerLaunchError(f"interpreter {exe} took over {timeout:.0f} s to {doing}") from exc
    except OSError as exc:
        raise ServerLaunchError(f"interpreter {exe} cannot be run to {doing}: {exc}") from exc


def check_requirement(
    python: str, requires: Requirement, *, env: dict[str, str] | None = None, timeout: float = 60
) -> str:
    """Prove `python` has `requires.distribution` in a tested version (before the launch, so an SGLang
    the plugin was not written for never starts); return the version."""
    full_env = {**os.environ, **(env or {})}
    exe = _resolve_executable(python, full_env)
    name = requires.distribution
    if exe is None:
        raise ServerLaunchError(f"no {name} environment: interpreter {python!r} not found; {requires.setup}")
    done = _probe(exe, _VERSION_OF, name, env=full_env, timeout=timeout, doing=f"report its {name} version")
    version = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else "-"
    if version == "-":
        raise ServerLaunchError(f"no {name} in interpreter {exe}: {requires.setup}")
    untested_ok = requires.allow_untested_env and full_env.get(requires.allow_untested_env) == "1"
    if version not in requires.versions and not untested_ok:
        override = f"; {requires.allow_untested_env}=1 tries it anyway" if requires.allow_untested_env else ""
        raise ServerLaunchError(
            f"{name} {version} in {exe} is not the tested {name} {', '.join(requires.versions)}: "
            f"{requires.setup}{override}"
        )
    return version


# prctl(2)'s option that makes the kernel signal a process when its parent dies.
_PR_SET_PDEATHSIG = 1


def _die_with(owner: int) -> Callable[[], None] | None:
    """What the forked server runs before exec: SIGKILL once its owner dies. A server in its own session
    outlives an owner killed by SIGKILL (no teardown runs), holding the port and the memory until the next
    launch on that port sweeps it; with nobody left to serve, nothing is lost by killing it. Linux only
    (None elsewhere: the next launch's sweep remains)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != owner:  # the owner died between the fork and prctl: no signal will come
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class _Spawner:
    """One thread, alive as long as the process, that forks every server. Linux sends the parent-death
    signal when the *thread* that forked the child exits, not its process: a server forked by a Prefect
    task's worker thread or an extraction pool's thread would be killed when that thread ends."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, job: Callable[[], Any]) -> Any:
        """`job()` on the spawning thread; its result, or its exception raised here."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # first use, or a forked copy of aerie
                self._thread = threading.Thread(target=self._serve, name="aerie-server-spawner", daemon=True)
                self._thread.start()
        done: Future[Any] = Future()
        self._jobs.put((job, done))
        return done.result()

    def _serve(self) -> None:
        while True:
            job, done = self._jobs.get()
            try:
                done.set_result(job())
            except BaseException as exc:  # handed to the caller, whatever it is
                done.set_exception(exc)


_SPAWNER = _Spawner()


class ProcessLauncher(Launcher):
    """The server as a local process in its own session, so its whole process group can be killed.

    SGLang's schedulers can be reparented away from the launcher, so a walk
    of the launcher's children misses them; `killpg` of the session's group does not. The server dies
    with this process (`_die_with`) unless `die_with_owner` is off (a server meant to outlive it).
    """

    def __init__(self, *, die_with_owner: bool = True) -> None:
        self.die_with_owner = die_with_owner
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._stopped: StopResult | None = None
        self._members: list[tuple[psutil.Process, str]] = []

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def pgid(self) -> int | None:
        # start_new_session=True makes the child a session and group leader: pgid == pid.
        return self._proc.pid if self._proc else None

    def preflight(self, spec: ServerSpec) -> None:
        if not spec.command:
            raise ServerLaunchError(f"server {spec.name}: empty command")
        if spec.interpreter and spec.requires:
            check_requirement(spec.interpreter, spec.requires, env=spec.env)
        if spec.interpreter and spec.module:
            check_interpreter(spec.interpreter, spec.module, env=spec.env, cwd=spec.cwd)
        elif _resolve_executable(spec.command[0], {**os.environ, **spec.env}) is None:
            raise ServerLaunchError(f"server {spec.name}: program {spec.command[0]!r} not found")

    def start(self, spec: ServerSpec) -> None:
        if self._proc is not None:
            raise ServerError(f"server {spec.name} was already started ({self.describe()})")
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **spec.env}
        env.setdefault("PYTHONUNBUFFERED", "1")  # log lines as they happen, not at exit
        self._log = spec.log_path.open("ab")
        log_file = self._log
        preexec = _die_with(os.getpid()) if self.die_with_owner else None
        try:
            self._proc = _SPAWNER.run(
                lambda: subprocess.Popen(
                    spec.command,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=spec.cwd,
                    start_new_session=True,
                    preexec_fn=preexec,
                )
            )
        except OSError as exc:
            self._log.close()
            raise ServerLaunchError(f"server {spec.name}: cannot start {spec.command[0]}: {exc}") from exc
        log.info("started %s: %s (log %s)", spec.name, self.describe(), spec.log_path)

    def exit_code(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def describe(self) -> str:
        return f"pid {self.pid} (process group {self.pgid})" if self._proc else "not started"

    def watch_members(self, vital: tuple[str, ...]) -> None:
        if self._proc is None:
            return
        try:
            children = psutil.Process(self._proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        self._members = []
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                name = child.name()
                if name.startswith(vital):
                    self._members.append((child, name))

    def lost_members(self) -> list[str]:
        lost = []
        for proc, name in self._members:
            try:
                # is_running() also compares the start time: a reused pid is not the process remembered.
                gone = not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                lost.append(f"pid {proc.pid} ({name})")
        return lost

    def kill(self) -> None:
        if self.pgid is not None:
            _killpg(self.pgid, signal.SIGKILL)

    def group_members(self) -> list[int]:
        """Live (non-zombie) processes still in the server's process group."""
        return live_group_members(self.pgid) if self.pgid is not None else []

    def stop(self, grace_s: float) -> StopResult:
        if self._stopped is not None:
            return self._stopped
        if self._proc is None or self.pgid is None:
            return StopResult(None, False, 0.0)
        began = time.monotonic()
        pgid = self.pgid
        killed = False
        if self.group_members():
            _killpg(pgid, signal.SIGTERM)
            if not self._wait_group_gone(grace_s):
                log.warning("%s still running %.0f s after SIGTERM: killing its process group", pgid, grace_s)
                _killpg(pgid, signal.SIGKILL)
                killed = True
                self._wait_group_gone(30.0)
        code: int | None
        try:
            code = self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = self._proc.poll()
        if self._log is not None:
            self._log.close()
        self._stopped = StopResult(code, killed, time.monotonic() - began)
        return self._stopped

    def _wait_group_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self._proc is not None
            self._proc.poll()  # reap the leader, or it lingers as a zombie in the group
            if not self.group_members():
                return True
            time.sleep(0.05)
        return not self.group_members()


def _killpg(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is already gone
        os.killpg(pgid, sig)


def live_group_members(pgid: int) -> list[int]:
    """Pids in process group `pgid` that are not zombies (a zombie holds no port, memory or GPU)."""
    members = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return members
