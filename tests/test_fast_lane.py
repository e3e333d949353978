"""The fast lane's guard (tests/conftest.py): under AERIE_FAST_LANE=1 a test that starts a child process or
binds a socket fails, naming what it did, and so do the tests that use a session fixture that starts a
server; without the variable the same tests pass. Run in a child pytest on a planted test file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # a child pytest

ROOT = Path(__file__).resolve().parent.parent
PROBE = """
import socket
import subprocess
import sys

import pytest


@pytest.fixture(scope="session")
def a_server():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    yield server
    server.close()


def test_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_binds_a_socket():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))


def test_uses_a_server_fixture(a_server):
    assert a_server.getsockname()[1] > 0


def test_computes():
    assert sum(range(4)) == 6
"""


def run_probe(tmp_path: Path, fast_lane: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "AERIE_FAST_LANE"}
    if fast_lane:
        env["AERIE_FAST_LANE"] = "1"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider"]
    argv += ["--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_guard_fails_processes_sockets_and_server_fixtures(tmp_path: Path) -> None:
    done = run_probe(tmp_path, fast_lane=True)
    assert done.returncode == 1, done.stdout
    assert "2 failed, 1 passed, 1 error" in done.stdout, done.stdout
    assert "the fast lane starts no child process (subprocess.Popen)" in done.stdout
    assert done.stdout.count("the fast lane starts no server (socket.bind)") >= 2, done.stdout


def test_without_the_lane_the_same_tests_pass(tmp_path: Path) -> None:
    done = run_probe(tmp_path, fast_lane=False)
    assert done.returncode == 0, done.stdout
    assert "4 passed" in done.stdout, done.stdout
