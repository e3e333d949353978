"""Prefect's docker work pool for real: a `prefect server start` process, the `aerie-docker` pool of
prefect.yaml (aerie/worker-cpu, built locally and never pulled), `prefect deploy`, `prefect deployment run`
of `aerie-pipeline/docker` with the tiny overrides, and `prefect worker start --type docker`, which runs
the flow in a container. The whole pipeline runs inside it (its servers as processes of that container)
and writes its stages into a store bind-mounted at the same path."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client

from tests import pipeline_support
from tests.conftest import free_port
from tests.docker_support import WORKER_IMAGE, api_unreachable_from, engine, require_image

pytest_plugins = ("tests.prefect_support",)
pytestmark = [pytest.mark.docker, pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
POOL = "aerie-docker"
FLOW_RUN_LABEL = "io.prefect.flow-run-id"  # prefect-docker's form of prefect.io/flow-run-id


@pytest.fixture(scope="module")
def client() -> Any:
    found = engine()
    require_image(found, WORKER_IMAGE)
    return found


async def _flow_run_state(flow_run_id: str) -> str:
    async with get_client() as prefect:
        run = await prefect.read_flow_run(flow_run_id)
        return run.state.type.value if run.state else "NONE"


def _engine_events(client: Any, since: int) -> list[dict[str, Any]]:
    return list(client.events(since=since, until=int(time.time()) + 1, decode=True))


def _containers_of(client: Any, flow_run_id: str) -> list[Any]:
    return client.containers.list(all=True, filters={"label": f"{FLOW_RUN_LABEL}={flow_run_id}"})


@pytest.mark.timeout(1200)
def test_the_docker_pool_runs_the_pipeline_in_the_worker_image(
    prefect_api, client: Any, tmp_path: Path
) -> None:
    api = prefect_api["url"]
    # A container that cannot reach the API would retry for minutes inside the flow run: find out first.
    problem = api_unreachable_from(client, WORKER_IMAGE, api, network_mode="host")
    assert problem is None, problem
    env = {**prefect_api["env"], "PREFECT_WORKER_QUERY_SECONDS": "2"}
    prefect = str(BIN / "prefect")

    def cli(*args: str) -> str:
        out = subprocess.run([prefect, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, f"prefect {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
        return out.stdout

    cli("work-pool", "create", POOL, "--type", "docker", "--overwrite")
    cli("--no-prompt", "deploy", "--name", "docker")
    store = tmp_path / "store"
    store.mkdir()
    overrides = [
        *pipeline_support.tiny_overrides(store, run="dock", port=free_port()),
        # One evaluation run (greedy, EAGLE-3, one MT-Bench question): the stage runs, in seconds.
        "evaluate.mtbench_questions=1",
        "evaluate.heldout_samples=0",
        "evaluate.temperatures=[0.0]",
        "evaluate.proposers=[eagle3]",
        "deploy.enabled=false",
    ]
    params = {"preset": "smollm2-local", "overrides": overrides}
    volumes = json.dumps([f"{store}:{store}"])
    out = cli(
        "deployment",
        "run",
        "aerie-pipeline/docker",
        "--params",
        json.dumps(params),
        "-jv",
        f"volumes={volumes}",
    )
    flow_run_id = next(w for line in out.splitlines() if "UUID" in line for w in line.split() if len(w) == 36)
    log = tmp_path / "worker.log"
    began = int(time.time())
    try:
        with open(log, "wb") as sink:
            worker = subprocess.run(
                [prefect, "worker", "start", "--pool", POOL, "--type", "docker", "--run-once"],
                cwd=REPO,
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                timeout=1000,
            )
        state = asyncio.run(_flow_run_state(flow_run_id))
        assert state == "COMPLETED", (
            f"flow run {state}, worker exit {worker.returncode}:\n{log.read_text()[-4000:]}"
        )
        assert _containers_of(client, flow_run_id) == []  # auto_remove: the flow run's container is gone
        events = _engine_events(client, began)
        ran = [
            e
            for e in events
            if e.get("Type") == "container" and e["Actor"]["Attributes"].get(FLOW_RUN_LABEL) == flow_run_id
        ]
        assert {e["Action"] for e in ran} >= {"create", "start", "die"}
        assert {e["Actor"]["Attributes"]["image"] for e in ran} == {WORKER_IMAGE}
        assert [e["Actor"]["Attributes"]["exitCode"] for e in ran if e["Action"] == "die"] == ["0"]
        assert [e for e in events if e.get("Type") == "image" and e["Action"] == "pull"] == []  # never pulled
    finally:
        for left in _containers_of(client, flow_run_id):
            left.remove(force=True)
    # Every stage's manifest is in the bind-mounted store, written from inside the container.
    stages = {p.parts[-3] for p in store.glob("dock/*/*/manifest.json")}
    assert {"generate-sharegpt", "merge", "extract", "train", "evaluate"} <= stages, sorted(stages)
    (evaluation,) = store.glob("dock/evaluate/*/manifest.json")
    assert json.loads(evaluation.read_text())["figures"]["prompts_mtbench"] == 1


def test_a_container_that_cannot_reach_the_api_is_named_before_any_flow_run(client: Any) -> None:
    problem = api_unreachable_from(client, WORKER_IMAGE, "http://127.0.0.1:9/api", network_mode="none")
    assert problem is not None
    assert problem.startswith(f"a container of {WORKER_IMAGE} on network none cannot reach the Prefect API")
    assert "host networking or the bridge gateway" in problem
