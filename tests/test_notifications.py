"""The automations of `deployments.notifications` on a real Prefect server, with real flow processes.

Three deployment runs of one flow, each a real flow process (`python -m prefect.engine`, as a worker
starts it) sending heartbeats every 30 s: one is SIGKILLed (its machine gone), one keeps running, one
completes at once. The killed one, and only it, is marked Crashed once it has been silent for the
automation's window, and that crash posts exactly one alert to a real local webhook.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client

from deployments.notifications import apply

pytestmark = pytest.mark.integration  # a Prefect server process and flow processes
pytest_plugins = ("tests.prefect_support", "tests.webhook_support")

FLOW = """import time
from prefect import flow


@flow(name="aerie-heartbeat-check")
def sleepy(seconds: float = 600) -> None:
    time.sleep(seconds)
"""
WINDOW_S = 60  # two heartbeats of 30 s (Prefect's least), so a live run is never mistaken for a dead one


def _state(run: UUID) -> str:
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run).state
    return state.type.value if state else "NONE"


def _wait(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(1)


@pytest.fixture
def flow_processes(prefect_api: dict[str, Any], tmp_path: Path) -> Iterator[Callable[..., tuple[UUID, Any]]]:
    """Starts deployment runs of the sleepy flow, each in its own flow process; kills what is left."""
    (tmp_path / "sleepy.py").write_text(FLOW)
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("aerie-heartbeat-check")
        deployment = client.create_deployment(
            flow_id=flow_id, name="check", entrypoint="sleepy.py:sleepy", path=str(tmp_path), tags=["aerie"]
        )
    started: list[subprocess.Popen[bytes]] = []

    def start(seconds: float) -> tuple[UUID, subprocess.Popen[bytes]]:
        with get_client(sync_client=True) as client:
            run = client.create_flow_run_from_deployment(
                deployment, parameters={"seconds": seconds}, tags=["aerie"]
            )
        env = {
            **prefect_api["env"],
            "PREFECT__FLOW_RUN_ID": str(run.id),
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect.engine"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        started.append(proc)
        return run.id, proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_run_whose_process_died_is_crashed_and_alerted_once(flow_processes, webhook) -> None:
    url, received = webhook
    apply(url, unresponsive_after_s=WINDOW_S)
    (dead, dead_proc), (alive, _) = flow_processes(600), flow_processes(600)
    quick, quick_proc = flow_processes(0)
    _wait(lambda: _state(dead) == _state(alive) == "RUNNING", 120, "both long runs RUNNING")
    os.killpg(dead_proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert quick_proc.wait(timeout=120) == 0

    _wait(lambda: _state(dead) == "CRASHED", WINDOW_S + 120, "the killed run marked CRASHED")
    silent_s = time.monotonic() - killed_at
    with get_client(sync_client=True) as client:
        crashed = client.read_flow_run(dead)
    assert crashed.state is not None and "no heartbeat for 60 s" in (crashed.state.message or "")
    # Not before its window: the last heartbeat came at most 30 s before the kill.
    assert silent_s >= WINDOW_S - 30, silent_s
    assert _state(alive) == "RUNNING" and _state(quick) == "COMPLETED"

    _wait(lambda: len(received) >= 1, 60, "the crash's alert")
    time.sleep(5)  # a second alert, were there one, would come within this
    (alert,) = [body["text"] for body in received]
    assert f"{crashed.name} is Crashed" in alert and "no heartbeat" in alert, alert
