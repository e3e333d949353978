"""The whole pipeline as a Prefect flow against a real Prefect server process on 127.0.0.1.

One tiny configuration runs every stage for real (reference server, generation, merge, extraction,
training, evaluation, deployment benchmark); the same config again is all cache hits; a changed
training parameter re-runs only training and what follows; a forced failure posts to a local webhook;
and `prefect deploy` of prefect.yaml + `prefect deployment run` is executed by a process worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prefect.client.orchestration import get_client
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings

from aerie.config import PipelineConfig, apply_overrides
from aerie.presets import get_preset
from aerie.settings import get_settings
from tests import pipeline_support
from tests.conftest import free_port

pytest_plugins = ("tests.webhook_support",)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STAGES = ["generate-sharegpt", "merge", "extract", "train", "evaluate", "deploy"]


def tiny_overrides(store: Path) -> list[str]:
    return pipeline_support.tiny_overrides(store, run="tiny", port=free_port())


def tiny_config(store: Path) -> PipelineConfig:
    return apply_overrides(get_preset("smollm2-local"), tiny_overrides(store))


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """A real `prefect server start` process (the worker and the CLI need a server they can reach)."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    log = open(home / "server.log", "wb")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"prefect server did not start: {(home / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)
    with temporary_settings({PREFECT_API_URL: url}):
        yield {"url": url, "env": {**env, "PREFECT_API_URL": url}}
        # Flush Prefect's log and event workers while this server still answers: left bound to a dead
        # server, they make the next module's prefect_test_harness hang in its own drain at teardown.
        APILogWorker.drain_all()
        EventsWorker.drain_all()
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    log.close()


def _by_stage(results) -> dict:
    return {r.stage: r for r in results}


def test_pipeline_runs_every_stage_caches_and_reruns_only_what_changed(prefect_api, tmp_path):
    from flows.pipeline import eagle3_pipeline

    cfg = tiny_config(tmp_path / "artifacts")
    first = _by_stage(eagle3_pipeline(config=cfg))
    assert list(first) == STAGES
    assert not any(r.cache_hit for r in first.values())
    assert first["extract"].figures["tokens"] == first["merge"].figures["tokens"]
    assert all(Path(r.manifest_uri).is_file() for r in first.values())

    second = _by_stage(eagle3_pipeline(config=cfg))
    assert [s for s, r in second.items() if not r.cache_hit] == []
    assert {s: r.manifest_sha256 for s, r in second.items()} == {
        s: r.manifest_sha256 for s, r in first.items()
    }

    changed = _by_stage(eagle3_pipeline(config=apply_overrides(cfg, ["train.lr=0.001"])))
    assert [s for s, r in changed.items() if r.cache_hit] == ["generate-sharegpt", "merge", "extract"]
    assert changed["train"].key != first["train"].key


def test_failure_posts_to_the_webhook(prefect_api, tmp_path, webhook, monkeypatch):
    from flows.pipeline import eagle3_pipeline

    url, received = webhook
    monkeypatch.setenv("AERIE_WEBHOOK_URL", url)
    get_settings.cache_clear()
    missing = tmp_path / "no-such-prompts.jsonl"
    cfg = apply_overrides(
        tiny_config(tmp_path / "artifacts"),
        ["generate.datasets.0.source.kind=jsonl", f"generate.datasets.0.source.path={missing}"],
    )
    try:
        state = eagle3_pipeline(config=cfg, return_state=True)
    finally:
        get_settings.cache_clear()
    assert state.is_failed()
    texts = [body["text"] for body in received]
    assert any("eagle3-pipeline" in t and str(missing) in t for t in texts), texts
    assert all(url not in t for t in texts)


def test_prefect_deploy_and_a_worker_runs_the_deployment(prefect_api, tmp_path):
    env = {**prefect_api["env"], "PREFECT_API_URL": prefect_api["url"]}
    prefect = str(BIN / "prefect")

    def cli(*args: str, timeout: float = 240) -> str:
        out = subprocess.run(
            [prefect, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert out.returncode == 0, f"prefect {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
        return out.stdout

    cli("work-pool", "create", "aerie-local", "--type", "process", "--overwrite")
    cli("--no-prompt", "deploy", "--name", "local")
    params = {"preset": "smollm2-local", "overrides": tiny_overrides(tmp_path / "artifacts")}
    out = cli("deployment", "run", "eagle3-pipeline/local", "--params", json.dumps(params))
    flow_run_id = next(w for line in out.splitlines() if "UUID" in line for w in line.split() if len(w) == 36)
    worker = subprocess.run(
        [prefect, "worker", "start", "--pool", "aerie-local", "--run-once"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )

    async def state() -> str:
        async with get_client() as client:
            run = await client.read_flow_run(flow_run_id)
            return run.state.type.value if run.state else "NONE"

    assert asyncio.run(state()) == "COMPLETED", worker.stdout[-3000:] + worker.stderr[-3000:]
