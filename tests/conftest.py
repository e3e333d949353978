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
