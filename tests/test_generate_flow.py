"""The generation stage's flow under a real Prefect test server: two datasets as parallel subflows (the
stage's parts) against a real local endpoint, with progress and table artifacts; a re-run generates nothing; a rejected key in
one dataset fails the flow without a task retry while the other dataset completes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentTaskRunId

from aerie.config import PipelineConfig
from aerie.datasets import SourceSpec
from aerie.errors import EndpointAuthError, EndpointError, SchemaError, SourceNotFoundError
from aerie.generate.config import DatasetSpec, EndpointConfig, GenerateConfig, SamplingParams
from aerie.generate.output import read_conversations
from aerie.manifest import StageResult
from aerie.stage import Upstream
from aerie.store import StoreConfig, open_store
from aerie.targets import TargetInfo
from flows.generate import POLICY
from flows.retrying import retry_unless
from flows.stage import run_stage
from tests.fault_server import FaultServer, status

pytest_plugins = ("tests.prefect_support",)
# integration: a Prefect test server and a local endpoint (one harness for every flow module)
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_harness")]


def _source(path: Path, prefix: str, n: int) -> SourceSpec:
    with open(path, "w") as f:
        for i in range(n):
            turns = [{"from": "human", "value": f"{prefix} question {i}"}, {"from": "gpt", "value": "old"}]
            f.write(json.dumps({"id": f"{prefix}{i}", "conversations": turns}) + "\n")
    return SourceSpec(kind="jsonl", path=str(path))


def _config(url: str, tmp_path: Path) -> GenerateConfig:
    endpoint = EndpointConfig(
        base_url=url, api_key_env="AERIE_TEST_FLOW_KEY", concurrency=2, backoff_base_s=0.01
    )
    datasets = [
        DatasetSpec(
            name=name,
            source=_source(tmp_path / f"{name}.jsonl", name, 3),
            sampling=SamplingParams(max_tokens=8),
        )
        for name in ("alpha", "beta")
    ]
    return GenerateConfig(
        endpoint=endpoint, datasets=datasets, max_parallel_datasets=2, max_failure_fraction=0.0
    )


def generate_all(
    cfg: GenerateConfig, store_cfg: StoreConfig, run: str, base_url: str, target: TargetInfo
) -> list[StageResult]:
    """The generation stage's flow over `cfg`'s datasets, against the endpoint at `base_url`."""
    cfg = cfg.model_copy(update={"endpoint": cfg.endpoint.model_copy(update={"base_url": base_url})})
    return run_stage("generate", PipelineConfig(run=run, store=store_cfg, generate=cfg), target, Upstream())


async def _artifacts_and_subflows() -> tuple[set[str], list[str]]:
    async with get_client() as client:
        keys = {a.key for a in await client.read_artifacts() if a.key}
        runs = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_task_run_id=FlowRunFilterParentTaskRunId(is_null_=False))
        )
        return keys, sorted(r.name for r in runs)


def test_datasets_run_as_parallel_subflows_and_cache(tmp_path: Path, smollm2):
    store_cfg = StoreConfig(uri=str(tmp_path / "store"))
    with FaultServer() as server:
        cfg = _config(server.url, tmp_path)
        first = generate_all(cfg, store_cfg, "flow", server.url, smollm2)
        assert [r.stage for r in first] == ["generate-alpha", "generate-beta"]
        assert [r.figures["records"] for r in first] == [3, 3]
        asked = len(server.seen)
        assert asked == 6

        store = open_store(store_cfg)
        frame = read_conversations(store.local_path(f"{first[1].prefix}/conversations.parquet"))
        assert frame["source"].unique().to_list() == ["beta"]

        keys, subflows = asyncio.run(_artifacts_and_subflows())
        assert {"flow-generate-alpha", "flow-generate-beta", "flow-generate-datasets"} <= keys
        assert {"generate-alpha-figures", "generate-beta-figures"} <= keys
        assert subflows == ["generate-alpha", "generate-beta"]  # linked under the generate stage's flow

        second = generate_all(
            cfg, store_cfg, "flow", "http://127.0.0.1:9/v1", smollm2
        )  # another URL: same key
        assert [r.manifest_sha256 for r in second] == [r.manifest_sha256 for r in first]
        assert len(server.seen) == asked  # nothing generated again


def test_rejected_key_fails_without_retry_and_spares_the_other_dataset(tmp_path: Path, smollm2):
    store_cfg = StoreConfig(uri=str(tmp_path / "store"))
    with FaultServer() as server:
        server.plan = {f"beta question {i}": [status(401)] for i in range(3)}
        cfg = _config(server.url, tmp_path)
        cfg.endpoint.concurrency = 1
        with pytest.raises(EndpointAuthError, match="rejected the API key"):
            generate_all(cfg, store_cfg, "flow-auth", server.url, smollm2)
        beta = [s for s in server.seen if s.prompt.startswith("beta")]
        assert len(beta) == 1  # stopped at the first 401: no request retry, no task retry
        alpha = open_store(store_cfg).list("flow-auth/generate-alpha")
        assert any(key.endswith("/manifest.json") for key in alpha)


class _FailedWith:
    """A task state whose result raises `exc` (what Prefect hands a retry condition)."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def result(self) -> None:
        raise self.exc


@pytest.mark.parametrize(
    ("exc", "retried"),
    [
        (SourceNotFoundError("prompts.jsonl: no such file"), False),
        (SchemaError("prompts.jsonl line 3: no 'messages' field"), False),
        (EndpointAuthError("401: bad key"), False),
        (EndpointError("the endpoint stayed down through every request retry"), True),
        (OSError("connection reset"), True),
    ],
)
def test_only_transient_failures_are_retried(exc: Exception, retried: bool) -> None:
    assert retry_unless(*POLICY.not_retried)(None, None, _FailedWith(exc)) is retried
