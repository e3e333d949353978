"""What flows show in the Prefect UI: progress artifacts, tables, images, and failure notifications.

Stages report through `aerie.progress.ProgressFn`; `prefect_progress` turns that into a progress
artifact (throttled, so a fast loop does not flood the API) and a log line every ~10%.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast
from uuid import UUID

import httpx
from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from aerie.manifest import StageResult
from aerie.pipeline import figure_text
from aerie.progress import ProgressFn, eta_text, terminal_progress
from aerie.settings import get_settings


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")[:100]


def prefect_progress(
    key: str, description: str, min_interval_s: float = 1.0, log_every_s: float = 30.0
) -> ProgressFn:
    """A ProgressFn that drives a Prefect progress artifact and, on a terminal (an interactive `aerie
    run`), a bar with rate and ETA; elsewhere (a worker's log) it logs each 10% and at least every
    `log_every_s`, with the share done, the time spent and an ETA from the rate so far."""
    artifact_id = cast(UUID, create_progress_artifact(0.0, key=artifact_key(key), description=description))
    logger = get_run_logger()
    bar = terminal_progress(description) if sys.stderr.isatty() else None
    lock = threading.Lock()
    started = time.monotonic()
    state: dict[str, float] = {"last": 0.0, "logged": started, "decile": -1, "warned": False}

    def update(fraction: float, message: str) -> None:
        if bar is not None:
            bar(fraction, message)
        pct = max(0.0, min(100.0, fraction * 100.0))
        now = time.monotonic()
        with lock:
            if pct < 100.0 and now - state["last"] < min_interval_s:
                return
            state["last"] = now
            decile = int(pct // 10)
            # With a bar on the terminal, lines in between would only break it: the last one is logged.
            due = decile != state["decile"] or now - state["logged"] >= log_every_s
            if due and (bar is None or pct >= 100.0):
                state["decile"], state["logged"] = decile, now
                logger.info("%s: %s; %s", description, eta_text(now - started, pct / 100.0), message)
        try:
            update_progress_artifact(
                artifact_id=artifact_id, progress=pct, description=f"{description}: {message}"
            )
        except Exception as exc:  # noqa: BLE001 - a progress bar must never fail hours of work
            if not state["warned"]:
                state["warned"] = True
                logger.warning("%s: progress artifact not updated (%r); the work goes on", description, exc)

    return update


def stage_table(result: StageResult, description: str) -> None:
    """A table artifact of a stage's key figures."""
    # Nested figures (extraction's phases) as a short text; numbers stay numbers.
    rows = [
        {"figure": k, "value": figure_text(v) if isinstance(v, dict) else v}
        for k, v in result.figures.items()
    ]
    rows.append({"figure": "cache hit", "value": result.cache_hit})
    rows.append({"figure": "manifest", "value": result.manifest_uri})
    create_table_artifact(rows, key=artifact_key(result.stage, "figures"), description=description)


def image_artifact(path: str | Path, key: str, description: str) -> None:
    """Embed a PNG in a markdown artifact (a data URI works without a public file server)."""
    data = base64.b64encode(Path(path).read_bytes()).decode()
    create_markdown_artifact(
        f"![{description}](data:image/png;base64,{data})", key=artifact_key(key), description=description
    )


# The stage each pipeline flow run is running (by flow run id), for its failure alert.
_RUNNING: dict[str, str] = {}


@contextlib.contextmanager
def running_stage(flow_run_id: str | None, stage: str) -> Iterator[None]:
    """While the pipeline flow runs `stage`: a failure inside it is that stage's (kept for the alert)."""
    if flow_run_id is not None:
        _RUNNING[flow_run_id] = stage
    yield
    if flow_run_id is not None:
        _RUNNING.pop(flow_run_id, None)


def failure_message(flow_name: str, flow_run: Any, state: Any, stage: str | None = None) -> dict[str, str]:
    """The Slack-compatible payload for a failed run: the run, the stage, the error's first line, a link."""
    ui = get_settings().prefect_ui_url
    link = f"{ui.rstrip('/')}/runs/flow-run/{flow_run.id}" if ui else f"flow run id {flow_run.id}"
    text = (
        f":red_circle: aerie run *{flow_run.name}* of flow `{flow_name}` is {state.name}"
        f"{f' in stage `{stage}`' if stage else ''}.\nError: {first_error_line(state)[:500]}\n{link}"
    )
    return {"text": text}


def first_error_line(state: Any) -> str:
    """`Type: first line of the message` of the exception that failed the run, else the state's message."""
    with contextlib.suppress(Exception):
        exc = state.result(raise_on_failure=False)
        if isinstance(exc, BaseException):
            lines = str(exc).strip().splitlines()
            return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    lines = (state.message or state.name or "").strip().splitlines()
    return lines[0] if lines else ""


def notify_failure(flow: Any, flow_run: Any, state: Any) -> None:
    """The pipeline flow's on_failure hook: one post to AERIE_WEBHOOK_URL per failed run, naming the
    stage that failed (the stage subflows post nothing: their failure fails this flow). A failed post is
    logged, never raised: a notification must not mask the run's own error. The URL is a secret and never
    logged. A run whose process died cannot run it: the automation of deployments/notifications.py
    posts for crashed and timed-out runs."""
    stage = _RUNNING.pop(str(flow_run.id), None)
    url = get_settings().webhook_url
    if url is None:
        return
    payload = failure_message(flow.name, flow_run, state, stage)
    try:
        httpx.post(url.get_secret_value(), json=payload, timeout=10.0).raise_for_status()
    except httpx.HTTPError as exc:
        get_run_logger().warning("failure notification not delivered: %s", type(exc).__name__)


class ShowEachTracebackOnce(logging.Filter):
    """Prefect logs a failure's traceback at every level it passes (the task, each subflow, the flow):
    the first record of an exception keeps it, the later ones keep only their line."""

    def __init__(self) -> None:
        super().__init__()
        self._shown: dict[int, BaseException] = {}  # by id, holding the exception so the id stays its own
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        with self._lock:
            if id(exc) in self._shown:
                record.exc_info, record.exc_text = None, None
            else:
                if len(self._shown) > 256:  # a long-lived worker: forget the oldest
                    self._shown.pop(next(iter(self._shown)))
                self._shown[id(exc)] = exc
        return True


def show_each_traceback_once() -> None:
    """Install `ShowEachTracebackOnce` on Prefect's flow- and task-run loggers (once per process)."""
    shown = ShowEachTracebackOnce()
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, ShowEachTracebackOnce) for f in logger.filters):
            logger.addFilter(shown)
