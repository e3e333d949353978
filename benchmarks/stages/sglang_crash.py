"""A kill -9 of SGLang's scheduler child, on this CPU: how long until aerie reports it, and how long SGLang
alone takes to end itself.

    python benchmarks/stages/sglang_crash.py [--runs 1] [--out benchmarks/results/sglang_crash-cpu.json]

Real SGLang (SGLang's own environment, `make setup-sglang`; the CPU shims on its PYTHONPATH) serves the
embedded target on the CPU engine. Each run starts it twice:

- through `ModelServer`: ready, one generation, SIGKILL to the `sglang::scheduler` process; the figure is
  the time from the kill to the serving watch's report (`crash_detected_at`), then to the whole process
  group gone;
- as a bare process (no watch): ready, the same kill; the figures are the times until SGLang's own
  subprocess watchdog logs the crash and until its main process has exited (its crash diagnostics wait
  5 s first), which is what a client of an unwatched server waits.

Writes {date, machine, command, figures}; start-up times are recorded too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from aerie.serving import ModelServer, ProcessLauncher, ServerConfig, spec_for  # noqa: E402
from aerie.serving.probe import Prober  # noqa: E402
from aerie.serving.spec import ServerSpec  # noqa: E402
from aerie.serving.startup_log import SUBPROCESS_CRASHED  # noqa: E402
from aerie.targets import resolve_target  # noqa: E402
from benchmarks import records  # noqa: E402
from tests.processes import free_port  # noqa: E402
from tests.sglang_support import cpu_config  # noqa: E402

SCHEDULER = "sglang::scheduler"


def scheduler_of(pid: int) -> psutil.Process:
    children = psutil.Process(pid).children(recursive=True)
    found = [c for c in children if c.name() == SCHEDULER]
    if len(found) != 1:
        raise SystemExit(
            f"expected one {SCHEDULER} under pid {pid}, found {[(c.pid, c.name()) for c in children]}"
        )
    return found[0]


def generate(url: str) -> None:
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    httpx.post(url + "/generate", json=body, timeout=120, trust_env=False).raise_for_status()


def watched_run(spec: ServerSpec) -> dict[str, Any]:
    began = time.monotonic()
    server = ModelServer(spec)
    with server:
        ready_s = time.monotonic() - began
        generate(server.url)
        launcher = server.launcher
        assert isinstance(launcher, ProcessLauncher) and launcher.pid is not None
        scheduler = scheduler_of(launcher.pid)
        killed = time.monotonic()
        scheduler.kill()
        while server.crash_detected_at is None and time.monotonic() - killed < 60:
            time.sleep(0.005)
        detected = server.crash_detected_at
        while launcher.group_members() and time.monotonic() - killed < 60:
            time.sleep(0.01)
        gone = time.monotonic()
    return {
        "ready_s": round(ready_s, 2),
        "detected_after_kill_s": round(detected - killed, 3) if detected is not None else None,
        "group_gone_after_kill_s": round(gone - killed, 3),
    }


def bare_run(spec: ServerSpec) -> dict[str, Any]:
    """The same server with no watch: the launcher only starts it; readiness is polled by hand."""
    launcher = ProcessLauncher()
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    launcher.start(spec)
    prober = Prober(spec.url)
    try:
        while not prober.health().ok:
            if launcher.exit_code() is not None or time.monotonic() - began > 900:
                raise SystemExit(f"the bare server did not come up; see {spec.log_path}")
            time.sleep(0.2)
        ready_s = time.monotonic() - began
        generate(spec.url)
        assert launcher.pid is not None
        scheduler = scheduler_of(launcher.pid)
        offset = spec.log_path.stat().st_size
        killed = time.monotonic()
        scheduler.kill()
        logged = None
        while launcher.exit_code() is None and time.monotonic() - killed < 120:
            if logged is None:
                with spec.log_path.open("rb") as f:
                    f.seek(offset)
                    if SUBPROCESS_CRASHED.search(f.read().decode(errors="replace")):
                        logged = time.monotonic()
            time.sleep(0.01)
        exited = time.monotonic()
    finally:
        prober.close()
        launcher.stop(5.0)
    return {
        "ready_s": round(ready_s, 2),
        "sglang_logged_after_kill_s": round(logged - killed, 3) if logged is not None else None,
        "sglang_exited_after_kill_s": round(exited - killed, 3),
    }


def summary(runs: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return None
    return {"median": round(statistics.median(values), 3), "max": max(values), "runs": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/aerie-sglang-crash"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sglang_crash-cpu.json")
    args = parser.parse_args()
    target = resolve_target("smollm2-135m-instruct")
    watched, bare = [], []
    for run in range(args.runs):
        for kind, runner, results in (("watched", watched_run, watched), ("bare", bare_run, bare)):
            work = args.work_dir / f"{kind}-{run}"
            calls = work / "shim-calls.txt"
            cfg = cpu_config(free_port(), calls, startup_timeout_s=900, grace_s=5.0)
            spec = spec_for(cfg, model_path=target.path, name=f"sglang-{kind}", log_path=work / "server.log")
            figures = runner(spec)
            figures["shim_calls"] = len(calls.read_text().splitlines()) if calls.exists() else 0
            print(kind, run, figures, flush=True)
            results.append(figures)
    record = {
        "date": records.now(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}, device cpu",
        "command": records.command(),
        "figures": {
            "target": target.name,
            "sglang": (ROOT / "envs" / "sglang" / "VERSION").read_text().strip(),
            "poll_interval_s": ServerConfig().poll_interval_s,
            "aerie_detected_after_kill_s": summary(watched, "detected_after_kill_s"),
            "aerie_group_gone_after_kill_s": summary(watched, "group_gone_after_kill_s"),
            "sglang_alone_logged_after_kill_s": summary(bare, "sglang_logged_after_kill_s"),
            "sglang_alone_exited_after_kill_s": summary(bare, "sglang_exited_after_kill_s"),
            "watched": watched,
            "bare": bare,
        },
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
