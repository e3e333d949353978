"""Shared fixtures. Everything runs against real local parts: the reference server as a process, a moto
S3 server over HTTP, a Prefect test server, local HTTP servers that inject faults."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import NoReturn

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


@pytest.fixture
def roomy_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans measured on a host with room (one filesystem, 1 PiB free), not on this machine, whose free
    disk (within a few GiB of a Kimi run's dumps and shards) and /dev/shm would decide a recommendation."""
    from aerie.plan import disk

    monkeypatch.setattr(disk, "_free", lambda path: (1, 1 << 50))


@pytest.fixture(scope="session")
def smollm2():
    """The embedded target, converted once (cached under ~/.cache/aerie)."""
    from aerie.targets import resolve_target

    return resolve_target("smollm2-135m-instruct")


# The fast lane (`make test-fast`: AERIE_FAST_LANE=1, the tests not marked integration, slow, gpu, docker or
# sglang) promises no child processes and no servers. This guard keeps the promise honest: under the fast
# lane, starting a process or binding a socket fails, naming what it did, so an unmarked test that needs
# the `integration` marker cannot slip into the lane. It is on for the whole session (an autouse session
# fixture comes before every other fixture), so a session- or module-scoped fixture that starts a server
# fails the tests that use it as well.
FAST_LANE = os.environ.get("AERIE_FAST_LANE") == "1"


class FastLaneViolation(AssertionError):
    """A test in the fast lane started a process or bound a socket: mark it `integration`."""


def _refuse(what: str) -> Callable[..., NoReturn]:
    def guard(*args: object, **kwargs: object) -> NoReturn:
        raise FastLaneViolation(f"the fast lane starts no {what}: mark this test `integration`")

    return guard


@pytest.fixture(autouse=True, scope="session")
def _fast_lane_guard() -> Iterator[None]:
    if not FAST_LANE:
        yield
        return
    import multiprocessing.process
    import socket
    import subprocess

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", _refuse("child process (subprocess.Popen)"))
        for name in ("fork", "system", "posix_spawn", "posix_spawnp"):
            patch.setattr(os, name, _refuse(f"child process (os.{name})"))
        patch.setattr(
            multiprocessing.process.BaseProcess, "start", _refuse("child process (multiprocessing)")
        )
        patch.setattr(socket.socket, "bind", _refuse("server (socket.bind)"))
        yield
