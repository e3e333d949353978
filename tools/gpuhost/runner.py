"""`run`: the stages in a child process within a time budget (SIGTERM, then SIGKILL, then a sweep of the
servers it left), and `pipeline`, that child."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from aerie.bundle.layout import InstallDir as Home
from aerie.bundle.unpack import require_unpacked
from aerie.errors import BundleError
from tools.gpuhost.hostenv import REPO, gpuhost_command, host_environ, install, run_child, verify_install
from tools.gpuhost.packout import pack_limits, pack_out

EXIT_STOPPED = 75  # EX_TEMPFAIL: the stages were stopped at the budget; the next run resumes


def _descendants(pid: int) -> list[Any]:
    try:
        import psutil

        return list(psutil.Process(pid).children(recursive=True))
    except Exception:  # psutil absent, or the process already gone: nothing to sweep
        return []


def _stop(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the pipeline (it tears its servers down and leaves every stage resumable), then after
    `grace_s` kill it and whatever it started that is still alive."""
    seen = {p.pid: p for p in _descendants(proc.pid)}
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        seen.update({p.pid: p for p in _descendants(proc.pid)})
        print(f"gpuhost: the stages did not stop {grace_s:.0f} s after SIGTERM: killing them", flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _sweep(seen.values())


def _sweep(processes: Iterable[Any]) -> None:
    """Kill what the pipeline started in process groups of its own (servers, torchrun) and left behind."""
    for p in processes:
        with contextlib.suppress(Exception):
            if p.is_running():
                p.terminate()
    for p in processes:
        with contextlib.suppress(Exception):
            p.wait(timeout=10)
    for p in processes:
        with contextlib.suppress(Exception):
            if p.is_running():
                p.kill()


def _tee(stream: IO[bytes], log: Path) -> threading.Thread:
    def pump() -> None:
        with open(log, "ab") as f:
            for line in iter(stream.readline, b""):
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
                f.write(line)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def run_stages(args: argparse.Namespace) -> int:
    started = time.monotonic()
    home = Home(Path(args.home))
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    rc = 1
    try:
        require_unpacked(home, "", "run")
        if install(home):
            verify_install(home)
        store = Path(args.store) if args.store else home.store
        done = run_child(home, ["config", "--home", str(home.root), "--store", str(store), args.preset,
                             *args.overrides], cache_dir, capture_output=True)  # fmt: skip
        if done.returncode != 0:
            raise BundleError(f"the host config could not be built:\n{(done.stdout + done.stderr).strip()}")
        config = done.stdout.strip().splitlines()[-1]
        rc = _supervise(home, config, args, cache_dir, started)
    finally:
        if args.out:
            since = time.time() - (time.monotonic() - started)
            pack_out(home, Path(args.out), since=since, **pack_limits(args))
    return rc


def _supervise(
    home: Home, config: str, args: argparse.Namespace, cache_dir: Path | None, started: float
) -> int:
    deadline = None
    if args.budget_s is not None:
        deadline = started + args.budget_s - args.grace_s - (args.pack_reserve_s if args.out else 0)
    logs = home.root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"run-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}.log"
    cmd = gpuhost_command("pipeline", config)
    cmd += ["--prefect"] if args.prefect else ["--until", args.until]
    stop_at = "no budget" if deadline is None else f"stopped at +{deadline - started:.0f} s"
    print(f"gpuhost: {' '.join(cmd)} ({stop_at}; log {log})", flush=True)
    proc = subprocess.Popen(
        cmd, env=host_environ(home, cache_dir), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    pump = _tee(proc.stdout, log)
    try:
        proc.wait(timeout=None if deadline is None else max(deadline - time.monotonic(), 0.0))
        stopped = False
    except subprocess.TimeoutExpired:
        print(
            f"gpuhost: budget reached after {time.monotonic() - started:.0f} s: stopping the stages",
            flush=True,
        )
        _stop(proc, args.grace_s)
        stopped = True
    pump.join(timeout=10)
    if stopped:
        print("gpuhost: stopped at the budget; the next `run` resumes from the store", flush=True)
        return EXIT_STOPPED
    print(
        f"gpuhost: the stages exited with {proc.returncode} after {time.monotonic() - started:.0f} s",
        flush=True,
    )
    return proc.returncode


def pipeline(args: argparse.Namespace) -> int:
    """The stages themselves (a child of `run`): SIGTERM becomes SystemExit, so `with` blocks (servers,
    journals, uploads) unwind as they do on an error. Generation runs its event loop in a worker thread
    that SystemExit does not reach, so a stop during generation ends with the supervisor's SIGKILL; its
    journal is fsynced per group of records and the supervisor sweeps the server, so that is safe too."""

    def _exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
    from flows.cli import main

    return main(["run", args.config] + ([] if args.prefect else ["--until", args.until]))
