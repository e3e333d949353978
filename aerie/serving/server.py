"""`ModelServer`: launch a server, prove it is up and that it is ours, and always tear it down.

    with ModelServer(spec, progress=bar, canary=check_dumps) as server:
        client = httpx.Client(base_url=server.url)
        ...

Each fault of a bash wait loop (poll `/health` until it answers) has its answer here:

| bash wait loop | here |
|---|---|
| wrong interpreter: dies at once, loop polls on | `ServerLaunchError` from the preflight, before any wait |
| a stale server answers `/health` 200 | the port must be free before the launch (`PortInUseError`) |
| polls every 10 s | polls every 0.2 s |
| cannot see a crash; waits the full 15 minutes | checks the process/container between polls: `ServerCrashedError` with the exit code and the server's own last log lines |
| any 200 is "ready" | `/health_generate` 200 *and* `/server_info` echoes this launch's nonce (`ServerIdentityError`) |
| `tail -2` every 30 s | every log line parsed into progress (shards, KV cache, CUDA graphs, fired up) |
| fixed 15-minute ceiling | a deadline from the model size, overridable; `ServerTimeoutError` with the last progress |
| 200 does not prove hidden states are written | a stage-specific canary runs before the server is handed out |
| kill and clear /dev/shm by hand | SIGTERM, grace, killpg/container removal, port freed, dead-pid segments swept |
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from aerie.errors import (
    AerieError,
    ServerCrashedError,
    ServerError,
    ServerIdentityError,
    ServerTimeoutError,
)
from aerie.progress import ProgressFn, no_progress
from aerie.serving.launcher import Launcher, ProcessLauncher, StopResult, describe_exit
from aerie.serving.probe import Prober, ensure_port_free, port_holders
from aerie.serving.spec import ServerSpec
from aerie.serving.startup_log import LogTail, StartupLog, error_summary, format_tail
from aerie.serving.teardown import (
    SERVER_OWNER_ENV,
    SERVER_TOKEN_ENV,
    clean_dump_dir,
    describe_pid,
    end_processes,
    list_segments,
    orphaned_servers,
    owner_mark,
    sweep_shm,
    tagged_processes,
    wait_port_free,
)
from aerie.serving.watch import EXITED, ServingWatch

log = logging.getLogger(__name__)

Canary = Callable[["ModelServer"], None]

# After a fatal log line, how long to let the server exit on its own (so its exit code is reported)
# before treating it as crashed anyway.
_FATAL_EXIT_WAIT_S = 2.0
_TAIL_LINES = 20
# Once the server's main process has exited there is nobody left to drain requests: what it left
# running gets this long after SIGTERM, not the full grace a live server gets.
_ORPHAN_GRACE_S = 1.0


@dataclass
class TeardownReport:
    """What teardown did, for logs and manifests."""

    stop: StopResult | None = None
    grace_s: float = 0.0  # the SIGTERM grace given (short when the main process had already exited)
    ended: list[int] = field(default_factory=list)  # processes it started outside its group, ended
    port_free: bool = True
    port_holders: list[int] = field(default_factory=list)  # pids still listening on the port
    swept: list[str] = field(default_factory=list)
    dump_files_removed: int = 0
    seconds: float = 0.0


def default_launcher(spec: ServerSpec) -> Launcher:
    """The process launcher for a command, the docker launcher for an image."""
    if spec.image is not None:
        from aerie.serving.container import DockerLauncher

        return DockerLauncher()
    return ProcessLauncher()


# Servers still up when the interpreter exits (an exception that skipped `with`, a SIGTERM turned into
# SystemExit) are torn down by atexit: a server runs in its own session and would otherwise outlive us,
# holding the port, the GPUs and /dev/shm.
_LIVE: weakref.WeakSet[ModelServer] = weakref.WeakSet()


@atexit.register
def _stop_live_servers() -> None:
    for server in list(_LIVE):
        try:
            server.stop()
        except Exception:  # at exit, one failure must not keep the others alive
            log.exception("teardown of %s at exit failed", server.spec.name)


class _SigtermAsExit:
    """Turn SIGTERM (a cancelled flow run, `kill`) into SystemExit while a server is starting or up,
    so `__exit__`/`finally` run and tear the server down. Only in the main thread, and only when
    nobody else (Prefect, a test runner) has installed a SIGTERM handler.
    """

    def __init__(self) -> None:
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    @staticmethod
    def _handle(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)


# How long a failed request waits for its server's exit to show before calling the server alive.
CRASH_SETTLE_S = 2.0


class ModelServer:
    """One model server's whole life: refuse a busy port, launch, wait until ready and verified, serve,
    tear down. `server.url` and `server.info` (its `/server_info`) are set once ready.
    """

    def __init__(
        self,
        spec: ServerSpec,
        *,
        launcher: Launcher | None = None,
        progress: ProgressFn = no_progress,
        canary: Canary | None = None,
    ) -> None:
        self.launcher = launcher or default_launcher(spec)
        if self.launcher.host_pids:
            # Marks every process of this launch, so teardown finds the ones that left the group.
            spec = spec.with_(env={**spec.env, SERVER_TOKEN_ENV: spec.nonce, SERVER_OWNER_ENV: owner_mark()})
        self.spec = spec
        self.progress = progress
        self.canary = canary
        self.info: dict[str, Any] = {}
        self.identity_endpoint: str | None = None
        self.health_endpoint: str | None = None
        self.ready_after_s: float | None = None
        self.teardown: TeardownReport | None = None
        self._tail = LogTail(spec.log_path)
        self._tail_lock = threading.Lock()  # the serving watch reads the log from its own thread
        self._startup = StartupLog()
        self._started = False
        self._watch: ServingWatch | None = None
        self._crash: ServerCrashedError | None = None
        self.crash_detected_at: float | None = None  # time.monotonic() when the watch saw the crash
        self._shm_before: set[str] = set()
        self._sigterm = _SigtermAsExit()

    @property
    def url(self) -> str:
        return self.spec.url

    # -- life -------------------------------------------------------------------------------------

    def __enter__(self) -> ModelServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> ModelServer:
        """Launch and wait until ready, verified and canaried; on any failure (KeyboardInterrupt
        included) tear down before re-raising, since `__exit__` does not run when `__enter__` fails.
        """
        if self._started:
            raise ServerError(f"{self.spec.name}: a ModelServer starts once; make a new one to relaunch")
        spec = self.spec
        self.progress(0.0, f"checking port {spec.port}")
        if self.launcher.host_pids:
            self._end_orphans()
        self.launcher.clear_port(spec)
        ensure_port_free(spec.host, spec.port)
        self.progress(0.0, "checking the launch")
        self.launcher.preflight(spec)
        if spec.sweep_shm:
            self._shm_before = list_segments(spec.shm_dir)
        self._skip_old_log()
        began = time.monotonic()
        self._sigterm.install()
        try:
            self._started = True  # from here on, stop() must run whatever happens
            _LIVE.add(self)
            self.launcher.start(spec)
            self._wait_ready(began)
            self._start_watch()
            if self.canary is not None:
                self.progress(0.995, "running the canary")
                self._run_canary()
        except BaseException:
            self.stop()
            raise
        self.ready_after_s = time.monotonic() - began
        self.progress(1.0, f"ready at {self.url} after {self.ready_after_s:.1f} s")
        log.info(
            "%s ready at %s after %.1f s (%s)",
            spec.name,
            self.url,
            self.ready_after_s,
            self.launcher.describe(),
        )
        return self

    def _run_canary(self) -> None:
        """A canary that failed because the server died under it proves nothing about its hidden
        states: report the crash (restartable), not a wrong canary."""
        assert self.canary is not None
        try:
            self.canary(self)
        except AerieError as exc:
            try:
                self.check_alive()
            except ServerCrashedError as crash:
                raise crash from exc
            raise

    def _skip_old_log(self) -> None:
        """A reused log path (appended to): read only what this launch writes."""
        self._tail = LogTail(self.spec.log_path)
        self._tail.seek_end()

    def stop(self) -> TeardownReport:
        """Tear down (idempotent): SIGTERM, grace, kill the group/container, wait for the port, sweep."""
        if self.teardown is not None:
            return self.teardown
        if not self._started:
            self.teardown = TeardownReport()
            self._sigterm.uninstall()
            return self.teardown
        began = time.monotonic()
        spec = self.spec
        report = TeardownReport()
        self.teardown = report
        if self._watch is not None:
            self._watch.stop()
        try:
            exited = self.launcher.exit_code() is not None
            report.grace_s = min(spec.grace_s, _ORPHAN_GRACE_S) if exited else spec.grace_s
            report.stop = self.launcher.stop(report.grace_s)
            report.ended = self._end_strays()
            report.port_free = wait_port_free(spec.host, spec.port, timeout=max(10.0, report.grace_s))
            if not report.port_free:
                report.port_holders = port_holders(spec.port)
                held = (
                    ", ".join(describe_pid(p) for p in report.port_holders)
                    or "a process this user cannot see"
                )
                log.warning("port %d is still bound after %s stopped, by %s", spec.port, spec.name, held)
            if spec.sweep_shm:
                report.swept = [str(p) for p in self._sweep()]
            if spec.clean_dump_dir and spec.dump_dir is not None:
                report.dump_files_removed = clean_dump_dir(spec.dump_dir)
        finally:
            report.seconds = time.monotonic() - began
            _LIVE.discard(self)
            self._sigterm.uninstall()
        log.info(
            "%s stopped (%s%s), port %s, %d segment(s) swept, in %.1f s",
            spec.name,
            describe_exit(report.stop.exit_code if report.stop else None),
            ", killed" if report.stop and report.stop.killed else "",
            "free" if report.port_free else "STILL BOUND",
            len(report.swept),
            report.seconds,
        )
        return report

    def _end_orphans(self) -> None:
        """A server an earlier run launched and could not tear down (it was killed with SIGKILL) holds
        the port: end it, saying so. One whose launcher still runs is left alone (and refused below)."""
        orphans = orphaned_servers(self.spec.port)
        for token, pids in orphans.items():
            log.warning(
                "port %d is held by a server left running by a run that was killed (%s): ending it",
                self.spec.port,
                ", ".join(describe_pid(p) for p in pids),
            )
            left = end_processes(pids, _ORPHAN_GRACE_S)
            if left:
                log.warning("could not end %s (launch %s)", ", ".join(map(str, left)), token)
        if orphans:
            wait_port_free(self.spec.host, self.spec.port, timeout=5.0)

    def _strays(self) -> list[int]:
        """Live processes of this launch other than its main process (they may have left its group)."""
        if not self.launcher.host_pids:
            return []
        main = getattr(self.launcher, "pid", None)
        return [p for p in tagged_processes(self.spec.nonce) if p != main]

    def _end_strays(self) -> list[int]:
        """End what the launch started and the group kill missed (a child in its own session)."""
        strays = self._strays()
        if not strays:
            return []
        log.warning(
            "%s left %s running outside its process group: ending it",
            self.spec.name,
            ", ".join(describe_pid(p) for p in strays),
        )
        left = end_processes(strays, _ORPHAN_GRACE_S)
        if left:
            log.warning("%s: %s still running after SIGKILL", self.spec.name, ", ".join(map(str, left)))
        return [p for p in strays if p not in left]

    def _leftovers(self) -> str:
        """What an exited server left behind, for its crash message: who holds its port, what runs."""
        strays = self._strays()
        holders = port_holders(self.spec.port)
        parts = []
        for pid in holders:
            whose = ", a process this server started," if pid in strays else " (not started by this server)"
            parts.append(f"port {self.spec.port} is still held by {describe_pid(pid)}{whose}")
        running = [p for p in strays if p not in holders]
        if running:
            parts.append("still running: " + ", ".join(describe_pid(p) for p in running))
        if not parts:
            return ""
        return "\nleft behind: " + "; ".join(parts) + " (teardown ends what this server started)"

    def _sweep(self) -> list[Path]:
        if self.launcher.host_pids:
            return sweep_shm(self.spec.shm_dir)
        # A container's pids are not ours: remove only the segments that appeared while it ran, and
        # only if no other container shares the host's IPC namespace.
        if self.launcher.shares_shm():
            log.info("not sweeping %s: another container shares the host IPC namespace", self.spec.shm_dir)
            return []
        new = list_segments(self.spec.shm_dir) - self._shm_before
        return sweep_shm(self.spec.shm_dir, only=new, is_alive=lambda pid: False)

    # -- readiness --------------------------------------------------------------------------------

    def _wait_ready(self, began: float) -> None:
        spec = self.spec
        deadline = began + spec.startup_timeout_s
        prober = Prober(self.url)
        fatal_since: float | None = None
        try:
            while True:
                self._read_log()
                code = self.launcher.exit_code()
                if code is not None:
                    raise self._crashed(code, began)
                if self._startup.fatal is not None:
                    # SGLang kills itself after these lines; give it a moment so its exit code is reported.
                    fatal_since = fatal_since or time.monotonic()
                    if time.monotonic() - fatal_since > _FATAL_EXIT_WAIT_S:
                        raise self._crashed(None, began)
                elif self._healthy(prober):
                    self._verify_identity(prober)
                    self._read_log()  # the ready line may have been written since the read above
                    return
                now = time.monotonic()
                if now >= deadline:
                    raise self._timed_out(began)
                time.sleep(min(spec.poll_interval_s, max(0.0, deadline - now)))
        finally:
            prober.close()

    def _read_log(self) -> None:
        for piece in self._tail.read_new():
            event = self._startup.feed(piece)
            if event is not None:
                self.progress(event.fraction, event.message)

    def _healthy(self, prober: Prober) -> bool:
        result = prober.health()
        self.health_endpoint = result.path
        return result.ok

    def _verify_identity(self, prober: Prober) -> None:
        found = prober.identity()
        if found is None:
            raise ServerIdentityError(
                f"{self.spec.name} at {self.url} is healthy but none of /server_info, /get_server_info, "
                f"/model_info reports a weight_version, so it cannot be shown to be the server launched "
                f"with --weight-version {self.spec.weight_version} ({self.launcher.describe()})."
            )
        path, info = found
        if info.get("weight_version") != self.spec.weight_version:
            raise ServerIdentityError(
                f"the server answering at {self.url} is not the one launched: GET {path} reports "
                f"weight_version={info.get('weight_version')!r}, model_path={info.get('model_path')!r}; "
                f"this launch passed --weight-version {self.spec.weight_version} "
                f"({self.launcher.describe()}). Another server owns the port or answers for it."
            )
        self.identity_endpoint, self.info = path, info

    def _last_lines(self) -> list[str]:
        return self._tail.last_lines(_TAIL_LINES)

    def _crashed(self, code: int | None, began: float) -> ServerCrashedError:
        self._tail.drain()
        lines = self._last_lines()
        cause = self._startup.fatal or error_summary(lines) or "no error line in the log"
        status = (
            self.launcher.describe_end(code)
            if code is not None
            else "reported a fatal error and has not exited"
        )
        head = (
            f"{self.spec.name} ({self.launcher.describe()}) {status} {time.monotonic() - began:.1f} s into "
            f"its start, at: {self._startup.message} ({self._startup.fraction:.0%}).\n"
            f"cause: {cause}{self._leftovers() if code is not None else ''}"
        )
        # Said now: the teardown that runs before this error propagates may take a while.
        log.error("%s", head)
        return ServerCrashedError(f"{head}\nlast lines of {self.spec.log_path}:\n{format_tail(lines)}")

    def _timed_out(self, began: float) -> ServerTimeoutError:
        lines = self._last_lines()
        return ServerTimeoutError(
            f"{self.spec.name} ({self.launcher.describe()}) was not ready after "
            f"{time.monotonic() - began:.0f} s (deadline {self.spec.startup_timeout_s:.0f} s; set "
            f"server.startup_timeout_s to change it). Last progress: {self._startup.message} "
            f"({self._startup.fraction:.0%}); {self.health_endpoint or '/health_generate'} not yet 200.\n"
            f"last lines of {self.spec.log_path}:\n{format_tail(lines)}"
        )

    # -- while serving ----------------------------------------------------------------------------

    @property
    def last_progress(self) -> tuple[float, str]:
        return self._startup.fraction, self._startup.message

    def log_tail(self, n: int = _TAIL_LINES) -> list[str]:
        """The server's last log lines (read up to now)."""
        with self._tail_lock:
            self._tail.read_new()
            return self._tail.last_lines(n)

    def _start_watch(self) -> None:
        self._watch = ServingWatch(
            self.launcher,
            self._tail,
            self._tail_lock,
            self.spec.poll_interval_s,
            self.spec.vital_children,
            self._on_crash,
        )
        self._watch.start()

    def _on_crash(self, what: str, detected_at: float) -> None:
        """From the watch: the server can no longer answer. Report it, and end what is left of it, so
        requests in flight fail now (SGLang itself waits some seconds for crash diagnostics first)."""
        code = self.launcher.exit_code() if self.launcher.host_pids else None
        if what == EXITED and code is not None:
            self._crash = self._exit_error(code)
        else:
            with self._tail_lock:
                pieces = self._tail.read_new()
                lines = self._last_lines()
            cause = what
            if self._watch is not None:
                self._watch.note(pieces)
                cause = self._watch.crash_line or error_summary(list(self._watch.lines_since_ready)) or what
            head = (
                f"{self.spec.name} ({self.launcher.describe()}) {what} while serving: it cannot answer "
                f"any more and is ended.\ncause: {cause}"
            )
            log.error("%s", head)
            self._crash = ServerCrashedError(
                f"{head}\nlast lines of {self.spec.log_path}:\n{format_tail(lines)}", after_ready=True
            )
        self.crash_detected_at = detected_at
        self.launcher.kill()

    def check_alive(self, settle_s: float = CRASH_SETTLE_S) -> None:
        """Raise `ServerCrashedError` (exit code + last log lines) if the server has exited, or lost a
        vital process, since it became ready; long-running clients call it when requests start failing.
        It waits up to `settle_s` for an exit to show: a killed process's sockets close (the client's
        request fails) a moment before its exit status can be read, a moment that grows on a loaded
        machine.
        """
        if not self._started:
            raise ServerError(f"{self.spec.name} was never started")
        if self._crash is not None:
            raise self._crash
        deadline = time.monotonic() + settle_s
        code = self.launcher.exit_code()
        while code is None and time.monotonic() < deadline:
            time.sleep(0.05)
            code = self.launcher.exit_code()
        if self._crash is not None:  # the watch saw it meanwhile
            raise self._crash
        if code is not None:
            raise self._exit_error(code)

    def _exit_error(self, code: int) -> ServerCrashedError:
        with self._tail_lock:
            self._tail.drain()
            lines = self._last_lines()
        head = (
            f"{self.spec.name} ({self.launcher.describe()}) exited while serving: {self.launcher.describe_end(code)}.\n"
            f"cause: {error_summary(lines) or 'no error line in the log'}{self._leftovers()}"
        )
        log.error("%s", head)
        return ServerCrashedError(
            f"{head}\nlast lines of {self.spec.log_path}:\n{format_tail(lines)}", after_ready=True
        )
