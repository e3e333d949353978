"""The fault matrix's Prefect cases (tests/faults/matrix.py): `aerie run` through a real `prefect server
start` process (tests/processes.py, the server the Prefect tests use), where generation's datasets and
extraction's slices run as subflows, and the pipeline as a deployment run that a process worker
executes (`prefect deploy --name local`, as tests/test_pipeline.py does). Faults: the API server
SIGKILLed and restarted on its port and database mid-run, the worker SIGKILLed mid-run, a deployment
run whose flow process is SIGKILLed and which is then run again. Each case ends with the run's state
compared, item by item, with an unfaulted `aerie run` through the same server's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import httpx

from tests.fault_check import Snapshot, compare
from tests.faults.case import ROOT, Case, wait_until
from tests.processes import BIN, prefect_server
from tests.webhook_support import receiver

POOL = "aerie-local"
# prefect.yaml's pools send a heartbeat every 60 s: two and a half of them.
UNRESPONSIVE_S = 150
DEPLOYMENT = "aerie-pipeline/local"


class Server:
    """One Prefect server for the matrix (its start costs ~10 s or more on a loaded host), restartable on
    its port and database."""

    def __init__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.home: Path | None = None
        self.base = ""
        self.port = 0
        self.deployed = False
        self.alerts: list[dict] = []  # what the failure automation posted to the matrix's webhook

    def start(self, home: Path) -> None:
        if self.base:
            return
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.base, _ = self.stack.enter_context(prefect_server(home, timeout_s=300))
        self.port = int(self.base.rsplit(":", 1)[1])

    def env(self, client_home: Path) -> dict[str, str]:
        # The client's own PREFECT_HOME: its profile and local storage apart from the server's database.
        client_home.mkdir(parents=True, exist_ok=True)
        return {
            "PREFECT_API_URL": f"{self.base}/api",
            "PREFECT_HOME": str(client_home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }

    def kill(self) -> int:
        """SIGKILL the server's process group (no clean shutdown); the pid killed."""
        pid = listener(self.port)
        os.killpg(os.getpgid(pid), signal.SIGKILL)
        self.stack.close()  # the context's stop() finds it gone
        self.stack = contextlib.ExitStack()
        self.base = ""
        return pid

    def restart(self) -> None:
        assert self.home is not None
        base, _ = self.stack.enter_context(prefect_server(self.home, timeout_s=300, port=self.port))
        self.base = base

    def close(self) -> None:
        self.stack.close()


SERVER = Server()


def listener(port: int) -> int:
    from tests.extract_support import listener_pid

    pid = listener_pid(port)
    if not pid:
        raise RuntimeError(f"nothing listens on port {port}")
    return int(pid)


class PipelineLike(Protocol):
    work: Path
    tmp: Path
    run: str
    overrides: list[str]
    prefect: dict[str, str] | None

    def start(self) -> subprocess.Popen[str]: ...
    def finish(self) -> tuple[int, str, str]: ...
    def snapshot(self) -> Snapshot: ...
    def completed(self, stage: str) -> bool: ...
    def env(self) -> dict[str, str]: ...


def prefect_cli(pipe: PipelineLike, *args: str, timeout: float = 300) -> str:
    done = subprocess.run(
        [str(BIN / "prefect"), *args],
        cwd=ROOT,
        env=pipe.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"prefect {' '.join(args)}: {done.stdout[-1500:]}\n{done.stderr[-1500:]}")
    return done.stdout


def deploy(pipe: PipelineLike) -> None:
    """The pipeline's deployment, and the README's automations posting to a webhook of the matrix."""
    if not SERVER.deployed:
        prefect_cli(pipe, "work-pool", "create", POOL, "--type", "process", "--overwrite")
        prefect_cli(pipe, "--no-prompt", "deploy", "--name", "local")
        url, SERVER.alerts = SERVER.stack.enter_context(receiver())
        argv = [
            "-m",
            "deployments.notifications",
            "--webhook-url",
            url,
            "--unresponsive-after",
            str(UNRESPONSIVE_S),
        ]
        done = subprocess.run(
            [str(BIN / "python"), *argv],
            cwd=ROOT,
            env={**os.environ, **pipe.env()},
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"deployments.notifications: {done.stderr[-1500:]}")
        SERVER.deployed = True


def alerts_of(pipe: PipelineLike, flow_run_id: str) -> list[str]:
    """The alerts posted about one flow run (by its name)."""
    url = pipe.env()["PREFECT_API_URL"]
    name = httpx.get(f"{url}/flow_runs/{flow_run_id}", timeout=10).json()["name"]
    return [a["text"] for a in SERVER.alerts if f" {name} is " in a.get("text", "")]


def deployment_run(pipe: PipelineLike) -> str:
    """A flow run of the pipeline deployment with this pipeline's overrides; its id."""
    params = {"preset": "smollm2-local", "overrides": pipe.overrides}
    out = prefect_cli(pipe, "deployment", "run", DEPLOYMENT, "--params", json.dumps(params))
    return next(w for line in out.splitlines() if "UUID" in line for w in line.split() if len(w) == 36)


def flow_state(pipe: PipelineLike, flow_run_id: str) -> str:
    url = pipe.env()["PREFECT_API_URL"]
    with contextlib.suppress(httpx.HTTPError):
        run = httpx.get(f"{url}/flow_runs/{flow_run_id}", timeout=10).json()
        return str((run.get("state") or {}).get("type", "NONE"))
    return "UNREACHABLE"


@contextlib.contextmanager
def worker(pipe: PipelineLike, log: Path, once: bool = False) -> Iterator[subprocess.Popen[bytes]]:
    argv = [str(BIN / "prefect"), "worker", "start", "--pool", POOL, *(["--run-once"] if once else [])]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=pipe.env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def extracting(pipe: PipelineLike) -> bool:
    """The extraction stage has begun writing (its work folder holds a file)."""
    return any(p.is_file() for p in (pipe.work / "extract-work").rglob("*"))


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    parents: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (proc / "stat").read_text()
                parents[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parents.items() if p in frontier]
        found += kids
        frontier = kids
    return found


def flow_processes(worker_pid: int) -> list[int]:
    """The flow run processes the worker started (`python -m prefect.engine`)."""
    out = []
    for pid in descendants(worker_pid):
        with contextlib.suppress(OSError):
            if b"prefect.engine" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
    return out


def case_api_restarted(pipe: PipelineLike, baseline: Snapshot) -> Case:
    """`aerie run` through Prefect; once extraction is writing, the API server is SIGKILLed and started
    again on its port and database. Whatever the run does (fails or carries on), a re-run must finish
    and its state equal an unfaulted run's."""
    proc = pipe.start()
    drain = Drain(proc)
    message = ""
    fired = False
    try:
        wait_until(lambda: extracting(pipe) or proc.poll() is not None, 900)
        if proc.poll() is None:
            pid = SERVER.kill()
            killed_at = time.monotonic()
            fired = True
            time.sleep(3.0)  # the run meets a dead API for a while
            SERVER.restart()
            message = f"API server (pid {pid}) SIGKILLed while extracting, back after {time.monotonic() - killed_at:.0f} s"
    finally:
        code = proc.wait(1800)
    line = drain.error_line()
    code2, _, err2 = pipe.finish()
    message += f"; the run exited {code}{': ' + line[:240] if line else ''}; re-run exit {code2}"
    if code2 != 0:
        message += ": " + error_line(err2)[:240]
    verdict = compare(baseline, pipe.snapshot())
    return Case.of(
        fired, "the Prefect API server SIGKILLed and restarted mid-run", None, verdict, message, code2 == 0
    )


def case_worker_killed(pipe: PipelineLike, baseline: Snapshot) -> Case:
    """A deployment run executed by a process worker; once extraction is writing, the worker's process
    group (the worker and the flow run it started) is SIGKILLed. The deployment is run again with a new
    worker: it must complete, its state equal to an unfaulted run's; the dead run, silent, must be
    marked Crashed by the unresponsive-run automation, which posts one alert about it."""
    deploy(pipe)
    first = deployment_run(pipe)
    fired, message = False, ""
    with worker(pipe, pipe.work / "worker-1.log") as w:
        wait_until(
            lambda: extracting(pipe) or flow_state(pipe, first) in ("COMPLETED", "FAILED", "CRASHED"), 1200
        )
        if flow_state(pipe, first) == "RUNNING":
            # The worker and what it started (the flow run's process), as when its host or container
            # dies: its process group, and the flow run's processes wherever they are.
            below = flow_processes(w.pid)
            os.killpg(w.pid, signal.SIGKILL)
            for pid in below:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            w.wait()
            fired = True
    state1 = flow_state(pipe, first)
    message = (
        f"worker SIGKILLed while its flow run extracted: that run left {state1}"
        if fired
        else f"no kill: {state1}"
    )
    began = time.monotonic()
    second = deployment_run(pipe)
    with worker(pipe, pipe.work / "worker-2.log", once=True) as w:
        w.wait(1800)
    state2 = flow_state(pipe, second)
    message += f"; the deployment run again: {state2} in {time.monotonic() - began:.0f} s"
    if fired:  # the automation's window counts from the dead run's last heartbeat
        with contextlib.suppress(RuntimeError):
            wait_until(
                lambda: flow_state(pipe, first) != "RUNNING" and bool(alerts_of(pipe, first)),
                UNRESPONSIVE_S + 120,
            )
        alerts = alerts_of(pipe, first)
        message += f"; the dead run then {flow_state(pipe, first)}, {len(alerts)} alert(s) about it"
    verdict = compare(baseline, pipe.snapshot())
    crashed = flow_state(pipe, first) == "CRASHED" and len(alerts_of(pipe, first)) == 1
    return Case.of(
        fired,
        "the Prefect worker SIGKILLed mid-run",
        None,
        verdict,
        message,
        state2 == "COMPLETED" and crashed,
    )


def case_deployment_retried(pipe: PipelineLike, baseline: Snapshot) -> Case:
    """A deployment run whose flow process is SIGKILLed while it extracts (the worker lives on): the
    worker reports the flow run Crashed, which posts one alert; the deployment, run again on the same
    worker, must complete, its state equal to an unfaulted run's."""
    deploy(pipe)
    first = deployment_run(pipe)
    killed: list[int] = []
    with worker(pipe, pipe.work / "worker.log") as w:
        wait_until(
            lambda: extracting(pipe) or flow_state(pipe, first) in ("COMPLETED", "FAILED", "CRASHED"), 1200
        )
        for pid in flow_processes(w.pid) if flow_state(pipe, first) == "RUNNING" else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        with contextlib.suppress(RuntimeError):
            wait_until(lambda: flow_state(pipe, first) in ("COMPLETED", "FAILED", "CRASHED"), 120)
        state1 = flow_state(pipe, first)
        began = time.monotonic()
        second = deployment_run(pipe)
        wait_until(lambda: flow_state(pipe, second) in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"), 1800)
        state2 = flow_state(pipe, second)
        alive = w.poll() is None
    alerts = alerts_of(pipe, first)
    message = (
        f"{len(killed)} flow process(es) SIGKILLed while extracting: the run left {state1} ({len(alerts)} "
        f"alert(s) about it); run again on the same worker (alive: {alive}): {state2} in "
        f"{time.monotonic() - began:.0f} s"
    )
    verdict = compare(baseline, pipe.snapshot())
    handled = state1 == "CRASHED" and len(alerts) == 1 and state2 == "COMPLETED" and alive
    return Case.of(
        bool(killed),
        "a deployment run's flow process SIGKILLed, the run retried",
        None,
        verdict,
        message,
        handled,
    )


class Drain:
    """Reads a child's stderr in a thread (so it never blocks on a full pipe), keeping the text."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        import threading

        self.chunks: list[str] = []
        threading.Thread(target=self._read, args=(proc.stderr, self.chunks), daemon=True).start()
        threading.Thread(target=self._read, args=(proc.stdout, []), daemon=True).start()

    @staticmethod
    def _read(stream: Any, into: list[str]) -> None:
        while chunk := stream.read(256):
            into.append(chunk)

    def error_line(self) -> str:
        return error_line("".join(self.chunks))


def error_line(err: str) -> str:
    return next((x for x in err.replace("\r", "\n").splitlines() if x.startswith("aerie: ")), "")


CASES: dict[str, Callable[[Any, Snapshot], Case]] = {
    "prefect_api_server_restarted_mid_run": case_api_restarted,
    "prefect_worker_killed_mid_run": case_worker_killed,
    "prefect_deployment_run_retried": case_deployment_retried,
}
