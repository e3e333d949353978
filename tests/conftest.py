"""Shared fixtures. Everything runs against real local parts: the reference server as a process, a moto
S3 server over HTTP, a Prefect test server, local HTTP servers that inject faults."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest

# Isolate Prefect from the developer's ~/.prefect and keep it offline and quiet.
_PREFECT_HOME = Path(tempfile.mkdtemp(prefix="aerie-prefect-"))
os.environ.setdefault("PREFECT_HOME", str(_PREFECT_HOME))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def smollm2():
    """The embedded target, converted once (cached under ~/.cache/aerie)."""
    from aerie.targets import resolve_target

    return resolve_target("smollm2-135m-instruct")
