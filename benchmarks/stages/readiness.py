"""Readiness, side by side: a bash wait loop vs aerie's `ModelServer`, on the same scenarios.

    python benchmarks/stages/readiness.py [--loop-cap-s 25] [--out benchmarks/results/readiness-cpu.json]

Both face the same SGLang-like server (`tests/fake_servers/sglang_like.py`: SGLang's log lines, port
bound only after loading, /health 503 until warm) in four scenarios:

- slow_start:        10 shards x 0.4 s, then a 1 s warm-up; the server comes up.
- crash_at_load:     the server dies with a traceback at shard 3 of 10.
- stale_server:      an old server already answers on the port; the new one loads, then dies at bind
                     with `[Errno 98] address already in use` (SGLang binds only after loading).
- kill_during_wait:  the server is SIGKILLed 2 s into its load (OOM killer, operator, node drain).

The bash loop is a common SGLang wait script, reimplemented faithfully: poll `/health` at
once, then every 10 s, 90 times (15 min); no liveness check; any 200 is "ready". It runs in REAL time,
with its real 10 s interval. It has no exit but a 200 or the 90th poll, so where it is still waiting at
`--loop-cap-s` we check that the server is dead and its port refuses connections; from then on every
remaining poll reads 000 and the loop can only end at 900 s with "no answer" — that outcome is reported
as projected (`"projected": true`), not measured. Event times (ready, crash) come from the server itself
(`--events-file`) or from the kill, so latencies are measured from what really happened.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from aerie.errors import (  # noqa: E402
    PortInUseError,
    ServerCrashedError,
    ServerError,
    ServerIdentityError,
    ServerTimeoutError,
)
from aerie.serving import ModelServer, ProcessLauncher  # noqa: E402
from benchmarks import records  # noqa: E402
from tests.fake_servers.scenarios import (  # noqa: E402
    TESTS_DIR,
    fake_command,
    fake_spec,
    free_port,
    start_stale_server,
)

LOOP_INTERVAL_S = 10.0
LOOP_POLLS = 90
SLOW = ["--shards", "10", "--shard-seconds", "0.4", "--warmup-seconds", "1.0"]
SCENARIOS: dict[str, dict[str, Any]] = {
    "slow_start": {"flags": SLOW, "expect": "ready"},
    "crash_at_load": {"flags": [*SLOW, "--crash-at-shard", "3"], "expect": "crashed"},
    "stale_server": {
        "flags": ["--shards", "4", "--shard-seconds", "0.5"],
        "expect": "refused",
        "stale": True,
    },
    "kill_during_wait": {"flags": [*SLOW, "--hang-at-shard", "6"], "expect": "crashed", "kill_at": 2.0},
}


@dataclass
class Outcome:
    scenario: str
    method: str
    verdict: str  # ready | crashed | refused | timeout | identity
    correct: bool
    false_positive: bool
    verdict_s: float | None  # from launch to the verdict
    event_s: float | None  # from launch to what really happened (ready, crash, kill)
    latency_s: float | None  # verdict - event
    projected: bool = False
    message: str = ""
    notes: list[str] = field(default_factory=list)


def read_events(path: Path) -> dict[str, float]:
    if not path.exists():
        return {}
    events = {}
    for line in path.read_text().splitlines():
        name, _, stamp = line.partition(" ")
        events.setdefault(name, float(stamp))
    return events


def killer(get_pid: Any, after_s: float, launched_at: float, out: dict[str, float]) -> threading.Thread:
    """SIGKILL the server `after_s` after the launch; record the wall time of the kill."""

    def run() -> None:
        while time.time() < launched_at + after_s:
            time.sleep(0.01)
        pid = None
        while pid is None:
            pid = get_pid()
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        out["kill"] = time.time()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def port_refuses(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return False
    except OSError:
        return True


# -- the bash loop -----------------------------------------------------------------------------------


def bash_loop(
    port: int, log: Path, cap_s: float, proc: subprocess.Popen[bytes]
) -> tuple[str, float, bool, str]:
    """The bash loop (poll /health, sleep 10, tail -2 every 3rd), in real time up to `cap_s`.

    Returns (verdict, seconds, projected, last output).
    """
    began = time.time()
    output = ""
    with httpx.Client(timeout=None, trust_env=False) as client:  # curl -s: no timeout
        for i in range(1, LOOP_POLLS + 1):
            try:
                code = str(client.get(f"http://localhost:{port}/health").status_code)
            except httpx.HTTPError:
                code = "000"
            if code == "200":
                return "ready", time.time() - began, False, f"Server ready after {i}0 seconds"
            if time.time() - began + LOOP_INTERVAL_S > cap_s:
                # The loop would sleep past the cap. Project the rest only if nothing can answer any more.
                if proc.poll() is not None and port_refuses(port):
                    return "timeout", LOOP_POLLS * LOOP_INTERVAL_S, True, output
                return "undecided", time.time() - began, False, output
            time.sleep(LOOP_INTERVAL_S)
            if i % 3 == 0:
                tail = log.read_text(errors="replace").replace("\r", "\n").strip().splitlines()[-2:]
                output = f"Waiting... {i}0s (http={code})\n" + "\n".join(tail)
    return "timeout", time.time() - began, False, output


def run_bash_loop(name: str, scenario: dict[str, Any], work: Path, cap_s: float) -> Outcome:
    port = free_port()
    events_file = work / "events"
    stale = start_stale_server(port, work / "stale.log") if scenario.get("stale") else None
    log = work / "server.log"
    launched = time.time()
    # nohup <python> -m sglang.launch_server ... > log 2>&1 &
    proc = subprocess.Popen(
        fake_command(port, "default", *scenario["flags"], "--events-file", str(events_file)),
        cwd=TESTS_DIR,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    kills: dict[str, float] = {}
    if "kill_at" in scenario:
        killer(lambda: proc.pid, scenario["kill_at"], launched, kills)
    try:
        verdict, seconds, projected, message = bash_loop(port, log, cap_s, proc)
        if verdict == "ready" and stale is not None:
            proc.wait(timeout=30)  # let the new server reach its bind, to record what it did
    finally:
        for p in (proc, stale):
            if p is not None:
                with_group_killed(p)
    events = read_events(events_file)
    event_at = kills.get("kill") or events.get("crash") or events.get("ready")
    event_s = event_at - launched if event_at else None
    ours_ready = "ready" in events
    false_positive = verdict == "ready" and not ours_ready
    expected = scenario["expect"]
    correct = (verdict == "ready" and expected == "ready" and ours_ready) or (
        expected != "ready" and verdict in ("crashed", "refused")
    )
    # A false positive has no detection latency: what it "detected" never happened.
    latency = seconds - event_s if event_s is not None and verdict == expected_verdict(expected) else None
    notes = []
    if projected:
        notes.append(
            f"measured to {cap_s:.0f} s: server dead, port refused; the loop can only end at "
            f"{LOOP_POLLS * LOOP_INTERVAL_S:.0f} s with no cause"
        )
    if false_positive:
        notes.append("HTTP 200 came from the stale server; the launched one died at bind")
    return Outcome(
        name, "bash", verdict, correct, false_positive, seconds, event_s, latency, projected, message, notes
    )


def expected_verdict(expected: str) -> str:
    """The bash loop cannot refuse a launch; the best it can do for a stale server is to not say ready."""
    return expected


def with_group_killed(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# -- aerie ------------------------------------------------------------------------------------------


def run_aerie(name: str, scenario: dict[str, Any], work: Path) -> Outcome:
    port = free_port()
    events_file = work / "events"
    stale = start_stale_server(port, work / "stale.log") if scenario.get("stale") else None
    spec = fake_spec(work, *scenario["flags"], "--events-file", str(events_file), port=port, grace_s=5.0)
    launcher = ProcessLauncher()
    server = ModelServer(spec, launcher=launcher)
    kills: dict[str, float] = {}
    launched = time.time()
    if "kill_at" in scenario:
        killer(lambda: launcher.pid, scenario["kill_at"], launched, kills)
    verdict, message = "ready", ""
    try:
        server.start()
        message = f"ready, weight_version={server.info.get('weight_version')}"
    except PortInUseError as exc:
        verdict, message = "refused", str(exc)
    except ServerCrashedError as exc:
        verdict, message = "crashed", str(exc)
    except ServerTimeoutError as exc:
        verdict, message = "timeout", str(exc)
    except ServerIdentityError as exc:
        verdict, message = "identity", str(exc)
    except ServerError as exc:
        verdict, message = type(exc).__name__, str(exc)
    seconds = time.time() - launched
    server.stop()
    if stale is not None:
        with_group_killed(stale)
    events = read_events(events_file)
    event_at = kills.get("kill") or events.get("crash") or events.get("ready")
    event_s = event_at - launched if event_at else (0.0 if verdict == "refused" else None)
    expected = scenario["expect"]
    correct = verdict == expected
    false_positive = verdict == "ready" and "ready" not in events
    latency = seconds - event_s if event_s is not None else None
    first_line = message.splitlines()[0] if message else ""
    cause = next((line for line in message.splitlines() if line.startswith("cause:")), "")
    return Outcome(
        name,
        "aerie",
        verdict,
        correct,
        false_positive,
        seconds,
        event_s,
        latency,
        False,
        first_line,
        [cause] if cause else [],
    )


# -- report -----------------------------------------------------------------------------------------


def fmt_s(value: float | None, projected: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:.0f} s (projected)" if projected else f"{value:.2f} s"


def loop_message_note(outcome: Outcome) -> None:
    """The bash loop prints "ready after ${i}0 seconds" although its first poll is at 0 s: 10 s too many."""
    if outcome.verdict == "ready" and outcome.message.startswith("Server ready after"):
        outcome.notes.append(
            f"the bash loop's own message reads {outcome.message!r} for a verdict at {outcome.verdict_s:.1f} s"
        )


def markdown(outcomes: list[Outcome], cap_s: float) -> str:
    rows = [
        "| scenario | bash loop: verdict | bash loop: verdict after | bash loop: after the event | "
        "aerie: verdict | aerie: verdict after | aerie: after the event |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {(o.scenario, o.method): o for o in outcomes}
    for name in SCENARIOS:
        loop, ours = by[(name, "bash")], by[(name, "aerie")]
        loop_verdict = "timeout, no cause" if loop.projected else loop.verdict
        if loop.false_positive:
            loop_verdict += " (FALSE POSITIVE)"
        loop_after = fmt_s(loop.latency_s)
        if loop.projected and loop.event_s is not None and loop.verdict_s is not None:
            loop_after = f"never; gives up {loop.verdict_s - loop.event_s:.0f} s later"
        elif loop.false_positive:
            loop_after = "n/a: said ready, its server died"
        rows.append(
            f"| {name} | {loop_verdict} | {fmt_s(loop.verdict_s, loop.projected)} | "
            f"{loop_after} | {ours.verdict}{'' if ours.correct else ' (WRONG)'} | "
            f"{fmt_s(ours.verdict_s)} | {fmt_s(ours.latency_s)} |"
        )
    rows += [
        "",
        f'Bash loop run in real time (10 s interval); "projected": measured for {cap_s:.0f} s, then the server '
        "was dead and its port refused, so the loop could only end at its 90th poll (900 s) without a cause. "
        "aerie polls every 0.2 s, watches the process between polls, refuses a busy port before launching "
        'and accepts only its own nonce. Times are from the launch; "after the event" is from the moment the '
        "server became ready, crashed or was killed.",
    ]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--loop-cap-s", type=float, default=25.0, help="real seconds the bash loop may run")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "readiness-cpu.json")
    parser.add_argument("--only", nargs="*", default=None, help="scenario names (default: all)")
    args = parser.parse_args()

    outcomes: list[Outcome] = []
    for name, scenario in SCENARIOS.items():
        if args.only and name not in args.only:
            continue
        for method in ("aerie", "bash"):
            with tempfile.TemporaryDirectory(prefix=f"readiness-{name}-{method}-") as tmp:
                work = Path(tmp)
                if method == "bash":
                    outcome = run_bash_loop(name, scenario, work, args.loop_cap_s)
                    loop_message_note(outcome)
                else:
                    outcome = run_aerie(name, scenario, work)
            outcomes.append(outcome)
            print(
                f"{name:18s} {method:6s} {outcome.verdict:10s} verdict after {fmt_s(outcome.verdict_s, outcome.projected)}"
                f" event at {fmt_s(outcome.event_s)}  {outcome.message[:90]!r}",
                flush=True,
            )

    table = markdown(outcomes, args.loop_cap_s) if not args.only else ""
    loop = [o for o in outcomes if o.method == "bash"]
    ours = [o for o in outcomes if o.method == "aerie"]
    figures = {
        "loop_interval_s": LOOP_INTERVAL_S,
        "loop_polls": LOOP_POLLS,
        "loop_cap_s": args.loop_cap_s,
        "loop_false_positives": sum(o.false_positive for o in loop),
        "aerie_false_positives": sum(o.false_positive for o in ours),
        "loop_correct": sum(o.correct for o in loop),
        "aerie_correct": sum(o.correct for o in ours),
        "scenarios": [asdict(o) for o in outcomes],
    }
    result = {
        "date": records.now(),
        "machine": f"{platform.node()} {platform.machine()} {psutil.cpu_count()} CPUs, Python {platform.python_version()}",
        "command": records.command(),
        "figures": figures,
        "table_markdown": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print()
    print(table)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
