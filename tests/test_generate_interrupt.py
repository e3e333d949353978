"""Ctrl-C during generation: the requests in flight are cancelled (not waited for), what finished is
kept, one line says what and how to resume, and a re-run asks only for the rest; a second Ctrl-C while
a generation is still running exits at once. Real processes, real signals, a real HTTP server whose
slow answers would hold the process for minutes if it waited for them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aerie.datasets import SourceSpec
from aerie.generate.config import DatasetSpec, EndpointConfig, GenerateConfig, SamplingParams
from aerie.store import LocalStore
from tests.fault_server import FaultServer, slow
from tests.generate_support import journal_ids
from tests.stage_work import generate_all

REPO = Path(__file__).resolve().parents[1]
CHILD = """
import faulthandler, signal, sys
# Ctrl-C as in a terminal. A process that ignores SIGINT passes that on to its children, and a pytest
# worker can: started in the background (as CI starts it) it ignores SIGINT, Polars' import replaces that
# behind Python's back, and a test restoring the handler Python knows (the train loop's) ignores it again.
signal.signal(signal.SIGINT, signal.default_int_handler)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hang shows where each thread waits
from aerie.generate.config import GenerateConfig
from aerie.store import LocalStore
from tests.stage_work import generate_all
cfg = GenerateConfig.model_validate_json(sys.argv[1])
try:
    generate_all(cfg, LocalStore(sys.argv[2]), "r")
except KeyboardInterrupt as exc:  # as the aerie command does
    print(f"aerie: interrupted: {exc}", file=sys.stderr)
    sys.exit(130)
"""
SLOW_S = 600.0  # far beyond any wait below: an exit before it proves the requests were not awaited


def config(tmp_path: Path, url: str, n: int) -> GenerateConfig:
    source = tmp_path / "source.jsonl"
    source.write_text(
        "".join(
            json.dumps({"id": f"c{i}", "conversations": [{"from": "human", "value": f"q{i}"}]}) + "\n"
            for i in range(n)
        )
    )
    spec = DatasetSpec(
        name="toy", source=SourceSpec(kind="jsonl", path=str(source)), sampling=SamplingParams(max_tokens=8)
    )
    endpoint = EndpointConfig(base_url=url, concurrency=2, read_timeout_s=SLOW_S * 2, max_retries=0)
    return GenerateConfig(endpoint=endpoint, datasets=[spec], max_failure_fraction=0.0)


def exited_within(child: subprocess.Popen[str], timeout_s: float) -> str:
    """The child's stderr once it exited; if it is still running after `timeout_s`, fail with every
    thread's stack (the child dumps them on SIGUSR1) and what it wrote."""
    try:
        return child.communicate(timeout=timeout_s)[1]
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGUSR1)
        time.sleep(2)
        child.kill()
        pytest.fail(f"the child did not exit within {timeout_s:.0f} s of Ctrl-C:\n{child.communicate()[1]}")


@pytest.mark.integration
def test_ctrl_c_cancels_requests_in_flight_keeps_what_finished_and_resumes(tmp_path: Path) -> None:
    n = 6
    with FaultServer() as server:
        server.plan = {"q0": [slow(SLOW_S)], "q1": [slow(SLOW_S)]}  # the two first sent hang
        cfg = config(tmp_path, server.url, n)
        store_root = tmp_path / "store"
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, cfg.model_dump_json(), str(store_root)],
            cwd=REPO,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        journal = store_root / "r" / "generate-toy" / "journal"
        deadline = time.monotonic() + 60
        # Wait until both hanging requests were sent (then the other slot answered the rest).
        while len(server.requests_for("q0")) + len(server.requests_for("q1")) < 2:
            assert child.poll() is None and time.monotonic() < deadline, "the child never sent its requests"
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        stderr = exited_within(child, 60)  # far less than SLOW_S: nothing waited for the answers
        assert child.returncode == 130
        assert "Traceback" not in stderr
        line = stderr.strip().splitlines()[-1]
        kept = set(journal_ids(journal))
        assert line.startswith("aerie: interrupted: generation stopped: dataset 'toy': ")
        assert f"{len(kept)} of {n} conversations kept" in line and "the same command resumes" in line
        assert str(journal) in line and {"c0", "c1"}.isdisjoint(kept)

        before = len(server.seen)
        server.plan = {}
        [result] = generate_all(cfg, LocalStore(store_root), "r")
        asked = {s.prompt for s in server.seen[before:]}
        assert asked == {f"q{i}" for i in range(n)} - {f"q{c[1:]}" for c in kept}  # only the rest
        assert result.figures["records"] == n


@pytest.mark.integration
def test_a_second_ctrl_c_exits_at_once_while_a_generation_still_runs() -> None:
    code = (
        "import os, signal, time\n"
        "from aerie.generate.interrupt import Active, arm_second_interrupt\n"
        "with Active():\n"
        "    arm_second_interrupt()\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(600)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 130
    assert "interrupted again: exiting now (1 generation(s) not flushed)" in done.stderr
