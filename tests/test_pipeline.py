"""The whole pipeline as a Prefect flow against a real Prefect server process on 127.0.0.1.

One tiny configuration runs every stage for real (reference server, generation, merge, extraction,
training, evaluation, deployment benchmark); the same config again is all cache hits; a changed
training parameter re-runs only training and what follows; a forced failure posts to a local webhook;
and `prefect deploy` of prefect.yaml + `prefect deployment run` is executed by a process worker (on the
first run's store: finished stages are cache hits there, a changed evaluation runs for real).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    LogFilter,
    LogFilterTimestamp,
)
from prefect.exceptions import ObjectNotFound
from prefect.logging.handlers import APILogWorker

from aerie.config import PipelineConfig, apply_overrides
from aerie.manifest import StageResult
from aerie.pipeline import run_pipeline
from aerie.presets import get_preset
from aerie.progress import no_progress
from aerie.settings import get_settings
from tests import pipeline_support
from tests.conftest import free_port

pytestmark = pytest.mark.integration  # a Prefect server process and reference servers

pytest_plugins = ("tests.prefect_support", "tests.webhook_support")

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STAGES = ["generate-sharegpt", "merge", "extract", "train", "evaluate", "deploy"]


def tiny_overrides(store: Path) -> list[str]:
    return pipeline_support.tiny_overrides(store, run="tiny", port=free_port())


def tiny_config(store: Path) -> PipelineConfig:
    return apply_overrides(get_preset("smollm2-local"), tiny_overrides(store))


@pytest.fixture(scope="module")
def pipeline_store(tmp_path_factory) -> Path:
    """The store of the full in-process run, shared with the worker's run: the worker's run then
    finds the upstream stages finished (as a re-run on another machine would) and runs for real only
    the stage its parameters change (the evaluation, from the worker's flow run). Run alone, the
    worker's test still passes, running every stage."""
    return tmp_path_factory.mktemp("pipeline") / "artifacts"


def _by_stage(results) -> dict:
    return {r.stage: r for r in results}


# Four whole pipeline runs (two through Prefect): past the default 600 s when the machine is shared.
@pytest.mark.timeout(1500)
def test_pipeline_runs_every_stage_caches_and_reruns_only_what_changed(prefect_api, pipeline_store):
    from flows.pipeline import aerie_pipeline

    cfg = tiny_config(pipeline_store)
    first = _by_stage(aerie_pipeline(config=cfg))
    assert list(first) == STAGES
    assert not any(r.cache_hit for r in first.values())
    assert first["extract"].figures["tokens"] == first["merge"].figures["tokens"]
    assert all(Path(r.manifest_uri).is_file() for r in first.values())
    # The served speed-up is predicted from SGLang's GPU times: a deployment on the CPU is given none.
    assert not any(k.startswith("predicted_speedup") for k in first["deploy"].figures)

    second = _by_stage(aerie_pipeline(config=cfg))
    assert [s for s, r in second.items() if not r.cache_hit] == []
    # A hit reports this run's seconds, with the seconds the stage took when it ran beside them.
    assert {s: r.original_seconds for s, r in second.items()} == {s: r.seconds for s, r in first.items()}
    assert {s: r.manifest_sha256 for s, r in second.items()} == {
        s: r.manifest_sha256 for s, r in first.items()
    }

    changed = _by_stage(aerie_pipeline(config=apply_overrides(cfg, ["train.lr=0.001"])))
    assert [s for s, r in changed.items() if r.cache_hit] == ["generate-sharegpt", "merge", "extract"]
    assert changed["train"].key != first["train"].key

    _shards_lost_then_rebuilt(pipeline_store, cfg, first["extract"])


def _shards_lost_then_rebuilt(store: Path, cfg: PipelineConfig, extract: StageResult) -> None:
    """A store holding an extraction's manifest but not its shards (what a fresh GPU host restores:
    `tools.gpuhost` never moves hidden states): a run whose training is done is all cache hits and
    extracts nothing; one whose training must run extracts the same shards again first. The store is
    put back as it was after, for the worker's test."""
    from flows.pipeline import aerie_pipeline

    stage = Path(store) / extract.prefix
    kept = {p: p.read_bytes() for p in stage.rglob("*") if p.is_file()}
    shards = {p: hashlib.sha256(b).hexdigest() for p, b in kept.items() if p.suffix == ".safetensors"}
    assert shards
    try:
        for path in shards:
            path.unlink()
        # The gpuhost's path (no Prefect): the trained config needs no shards; nothing is extracted.
        report = run_pipeline(
            apply_overrides(cfg, ["train.lr=0.001"]), until="deploy", progress=lambda _name: no_progress
        )
        assert [r.stage for r in report.results if not r.cache_hit] == []
        assert not any(p.exists() for p in shards)
        # A new training (the Prefect flow): the extraction is made again, byte for byte, then trained on
        # (and evaluated; the deployment benchmark, two more server starts, is left out: not about shards).
        retrain = apply_overrides(cfg, ["train.lr=0.0005", "deploy.enabled=false"])
        rebuilt = _by_stage(aerie_pipeline(config=retrain))
        assert list(rebuilt) == STAGES[:-1]
        assert [s for s, r in rebuilt.items() if r.cache_hit] == ["generate-sharegpt", "merge"]
        assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in shards} == shards
        assert rebuilt["extract"].key == extract.key
    finally:
        for path, data in kept.items():
            path.write_bytes(data)


def test_failure_posts_to_the_webhook(prefect_api, tmp_path, webhook, monkeypatch):
    from dataclasses import replace

    import flows.stage
    from flows.pipeline import aerie_pipeline

    url, received = webhook
    monkeypatch.setenv("AERIE_WEBHOOK_URL", url)
    # A missing source is not retried (it would fail the same way 30 s and 120 s later), but should
    # that rule regress, waits of 0 keep this test about the failure and its webhook post.
    policy = replace(flows.stage.POLICIES["generate"], retry_delay_s=0)
    monkeypatch.setitem(flows.stage.POLICIES, "generate", policy)
    get_settings.cache_clear()
    missing = tmp_path / "no-such-prompts.jsonl"
    cfg = apply_overrides(
        tiny_config(tmp_path / "artifacts"),
        ["generate.datasets.0.source.kind=jsonl", f"generate.datasets.0.source.path={missing}"],
    )
    started = datetime.now(timezone.utc)
    try:
        state = aerie_pipeline(config=cfg, return_state=True)
    finally:
        get_settings.cache_clear()
    assert state.is_failed()
    # One failure, one alert: the run, the stage, the error's first line (no traceback, no secret).
    (text,) = [body["text"] for body in received]
    assert "aerie-pipeline" in text and "in stage `generate`" in text and str(missing) in text, text
    assert "Traceback" not in text and url not in text
    assert text.count("\n") == 2, text  # the headline, the error's first line, the link
    # The traceback once in the run's logs, however many levels (task, subflows, flow) it passed.
    APILogWorker.drain_all()
    logs = asyncio.run(_logs_since(started))
    assert sum(log.message.count("Traceback (most recent call last)") for log in logs) == 1, [
        log.message[:200] for log in logs
    ]


async def _logs_since(started: datetime) -> list:
    async with get_client() as client:
        return await client.read_logs(log_filter=LogFilter(timestamp=LogFilterTimestamp(after_=started)))


def test_prefect_deploy_and_a_worker_runs_the_deployment(prefect_api, pipeline_store):
    env = {**prefect_api["env"], "PREFECT_API_URL": prefect_api["url"]}
    prefect = str(BIN / "prefect")

    def cli(*args: str, timeout: float = 240) -> str:
        out = subprocess.run(
            [prefect, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert out.returncode == 0, f"prefect {' '.join(args)}:\n{out.stdout}\n{out.stderr}"
        return out.stdout

    # The README's own lines: the pool, then the deployment, which registers aerie-pipeline/local alone.
    cli(*_readme_command("prefect work-pool create"))
    cli(*_readme_command("prefect --no-prompt deploy"))
    assert asyncio.run(_deployment_exists("aerie-pipeline/local"))
    assert not asyncio.run(_deployment_exists("extract-slice/local"))
    # Another evaluation than the in-process run's: the worker's flow run does real work (the deployment
    # benchmark, two server starts, is left out: the evaluation is the cheaper stage to change).
    overrides = [*tiny_overrides(pipeline_store), "evaluate.mtbench_questions=1", "deploy.enabled=false"]
    evaluations = set(pipeline_store.glob("tiny/evaluate/*/manifest.json"))
    params = {"preset": "smollm2-local", "overrides": overrides}
    out = cli("deployment", "run", "aerie-pipeline/local", "--params", json.dumps(params))
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
    (made,) = set(pipeline_store.glob("tiny/evaluate/*/manifest.json")) - evaluations
    evaluation = json.loads(made.read_text())
    assert evaluation["figures"]["prompts_mtbench"] == 1
    # On the flow run itself: the live progress, finished, and the headline table.
    artifacts = {a.key: a for a in asyncio.run(_artifacts_of(flow_run_id))}
    assert artifacts["tiny-progress"].type == "progress" and artifacts["tiny-progress"].data == 100.0
    summary = json.loads(artifacts["tiny-summary"].data)
    drafter = next(r for r in summary if r["figure"].startswith("accept length, mtbench, eagle3"))
    k = max(evaluation["config"]["num_steps"])
    assert drafter["value"] == round(evaluation["figures"][f"accept_mtbench_eagle3_k{k}"], 3)
    lookup = evaluation["figures"][f"accept_mtbench_prompt_lookup_k{k}"]
    assert drafter["against"] == f"prompt lookup {lookup:.3f}"
    assert {"figure": "served", "value": "not measured", "against": "no deploy stage in this run"} in summary


def _readme_command(start: str) -> list[str]:
    """The README's Prefect section's line that starts with `start`, as arguments after `prefect`."""
    section = (REPO / "README.md").read_text().split("## Prefect deployments and the UI", 1)[1]
    (line,) = [line for line in section.splitlines() if line.startswith(start)]
    return shlex.split(line.split("#", 1)[0])[1:]


async def _deployment_exists(name: str) -> bool:
    async with get_client() as client:
        try:
            await client.read_deployment_by_name(name)
        except ObjectNotFound:
            return False
        return True


async def _artifacts_of(flow_run_id: str) -> list:
    async with get_client() as client:
        found = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run_id)]))
        return await client.read_artifacts(artifact_filter=found)


@pytest.mark.timeout(900)
def test_a_run_without_prefect_hashes_the_extraction_key_once(tmp_path, monkeypatch):
    """The extraction's key is worked out once per run (`Stage.stage_dir` remembers it for the run):
    the composer's look-ahead (`aerie.pipeline.rebuild_missing`), `needs` and the stage's run share it,
    and nothing below the stage hashes it again; on a fresh run and on a re-run of cache hits."""
    import aerie.extract.plan

    calls: list[str] = []
    real = aerie.extract.plan.extract_key

    def counted(*args, **kwargs):
        calls.append(key := real(*args, **kwargs))
        return key

    monkeypatch.setattr(aerie.extract.plan, "extract_key", counted)
    cfg = apply_overrides(tiny_config(tmp_path / "artifacts"), ["deploy.enabled=false"])
    for run in ("fresh", "cached"):
        calls.clear()
        report = run_pipeline(cfg, until="train", progress=lambda _name: no_progress)
        extract = _by_stage(report.results)["extract"]
        assert extract.cache_hit == (run == "cached")
        assert calls == [extract.key], run
