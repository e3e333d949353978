"""Progress in the Prefect path: a progress artifact, and log lines with the share done, the time spent
and an ETA, at each 10% and at least every `log_every_s` (a long step never goes quiet)."""

from __future__ import annotations

import asyncio

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogWorker

from aerie.progress import eta_text
from flows.reporting import prefect_progress

pytest_plugins = ("tests.prefect_support",)
# integration: a Prefect test server
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_harness")]


@flow(name="progress-probe")
def progress_probe() -> str:
    from prefect.runtime import flow_run

    update = prefect_progress("probe", "probing", min_interval_s=0.0, log_every_s=0.0)
    for fraction in (0.01, 0.02, 0.03, 1.0):  # three updates inside one decile, then the end
        update(fraction, f"step {fraction}")
    return str(flow_run.id)


async def _messages(run_id: str) -> list[str]:
    async with get_client() as client:
        logs = await client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
        return [log.message for log in logs]


def test_progress_lines_carry_the_eta_and_do_not_wait_for_the_next_decile():
    run_id = progress_probe()
    # The run's logs reach the server in the background; drained outside an event loop, where drain_all
    # waits (inside one it only returns a coroutine).
    APILogWorker.drain_all()
    lines = [m for m in asyncio.run(_messages(run_id)) if m.startswith("probing:")]
    assert len(lines) == 4, lines  # every update was due (log_every_s=0), not only each 10%
    assert "left; step 0.02" in lines[1] and lines[1].startswith("probing: 2.0% in ")
    assert lines[-1].startswith("probing: 100.0% in ")


def test_eta_comes_from_the_rate_so_far():
    assert eta_text(60.0, 0.25) == "25.0% in 1m00s, ~3m00s left"
    assert eta_text(7200.0, 0.5) == "50.0% in 2h00m, ~2h00m left"
    assert eta_text(5.0, 0.0) == "0% after 0m05s"
