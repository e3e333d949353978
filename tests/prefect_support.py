"""Prefect servers for tests, each started once per session (a start costs ~10 s on a 2-core host).

Use it from a test module with a plugin line (not an import: the fixtures must be defined once to be
shared, and ruff flags imported fixtures as F811):

    pytest_plugins = ("tests.prefect_support",)

`prefect_harness` (session): Prefect's own test harness (a server subprocess on a temporary SQLite
database), for modules that run flows in this process. A module uses it with
`pytestmark = pytest.mark.usefixtures("prefect_harness")`. The flow modules share it; each of them
publishes artifacts under its own keys, so their artifact checks still see only their own output.

`prefect_api` (module): a real `prefect server start` process on 127.0.0.1 (the worker and the CLI
need a server they can reach), with this process pointed at it for the module's duration. The process
itself (`prefect_server_process`) is started once per session.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.testing.utilities import prefect_test_harness

from tests.processes import prefect_server


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def prefect_server_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Start `prefect server start` and wait for /health; yields its API URL and environment."""
    with prefect_server(tmp_path_factory.mktemp("prefect-home")) as (base, env):
        url = f"{base}/api"
        yield {"url": url, "env": {**env, "PREFECT_API_URL": url}}


@pytest.fixture(scope="module")
def prefect_api(prefect_server_process: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The real server, with this process's Prefect settings pointed at it for the module."""
    with temporary_settings({PREFECT_API_URL: prefect_server_process["url"]}):
        yield prefect_server_process
        # Flush Prefect's log and event workers while this server is still the one they talk to: left
        # bound to it, they would post the next module's logs to the wrong server, or hang a
        # prefect_test_harness in its own drain at teardown once this server is gone.
        APILogWorker.drain_all()
        EventsWorker.drain_all()
