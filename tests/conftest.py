"""Shared fixtures. Everything runs against real local parts: the reference server as a process, a moto
S3 server over HTTP, a Prefect test server, local HTTP servers that inject faults."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

from tests.processes import free_port  # noqa: F401 - the tests import it from here

# Isolate Prefect from the developer's ~/.prefect and keep it offline and quiet. Made once, by the first
# process (pytest-xdist's workers inherit it), and removed when that process exits.
if "PREFECT_HOME" not in os.environ:
    _PREFECT_HOME = tempfile.mkdtemp(prefix="aerie-prefect-")
    os.environ["PREFECT_HOME"] = _PREFECT_HOME
    atexit.register(shutil.rmtree, _PREFECT_HOME, ignore_errors=True)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded target, converted once (cached under ~/.cache/aerie)."""
    from aerie.targets import resolve_target

    return resolve_target("smollm2-135m-instruct")


# The fast lane (`make test-fast`: AERIE_FAST_LANE=1, the tests not marked integration, slow, gpu, docker or
# sglang) promises no child processes and no servers. This guard keeps the promise honest: under the fast
# lane a test that starts a process or binds a socket fails, naming what it did, so an unmarked test that
# needs the `integration` marker cannot slip into the lane.
FAST_LANE = os.environ.get("AERIE_FAST_LANE") == "1"


class FastLaneViolation(AssertionError):
    """A test in the fast lane started a process or bound a socket: mark it `integration`."""


@pytest.fixture(autouse=True)
def _fast_lane_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    if not FAST_LANE:
        return
    import multiprocessing.process
    import socket
    import subprocess

    def refuse(what: str):  # type: ignore[no-untyped-def]
        def guard(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise FastLaneViolation(f"the fast lane starts no {what}: mark this test `integration`")

        return guard

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("child process (subprocess.Popen)"))
    monkeypatch.setattr(os, "fork", refuse("child process (os.fork)"))
    monkeypatch.setattr(
        multiprocessing.process.BaseProcess, "start", refuse("child process (multiprocessing)")
    )
    monkeypatch.setattr(socket.socket, "bind", refuse("server (socket.bind)"))
