"""What flows show in the Prefect UI: progress artifacts, tables, images, and failure notifications.

Stages report through `aerie.progress.ProgressFn`; `prefect_progress` turns that into a progress
artifact (throttled, so a fast loop does not flood the API) and a log line every ~10%.
"""

from __future__ import annotations

import base64
import re
import sys
import threading
import time
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


def failure_message(flow_name: str, flow_run: Any, state: Any) -> dict[str, str]:
    """The Slack-compatible payload for a failed or crashed run: flow, run, stage, error and a link."""
    ui = get_settings().prefect_ui_url
    link = f"{ui.rstrip('/')}/runs/flow-run/{flow_run.id}" if ui else f"flow run id {flow_run.id}"
    error = (state.message or state.name or "").strip()
    stage = _failed_stage(error)
    text = (
        f":red_circle: aerie run *{flow_run.name}* of flow `{flow_name}` is {state.name}"
        f"{f' in stage `{stage}`' if stage else ''}.\nError: {error[:1500]}\n{link}"
    )
    return {"text": text}


def _failed_stage(message: str) -> str | None:
    match = re.search(r"(generate|merge|extract|train|evaluate|deploy)[\w-]*", message)
    return match.group(0) if match else None


def notify_failure(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow hook (on_failure / on_crashed): post to AERIE_WEBHOOK_URL. A failed post is logged, never raised:
    a notification must not mask the run's own error. The URL is a secret and never logged."""
    url = get_settings().webhook_url
    if url is None:
        return
    payload = failure_message(flow.name, flow_run, state)
    try:
        httpx.post(url.get_secret_value(), json=payload, timeout=10.0).raise_for_status()
    except httpx.HTTPError as exc:
        get_run_logger().warning("failure notification not delivered: %s", type(exc).__name__)
