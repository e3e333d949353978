"""Generation into a remote store (S3Store on a real moto server): the journal lives in a local work
dir and is mirrored to the store, so a run on another machine (an empty work dir) resumes from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aerie.datasets import SourceSpec
from aerie.generate.config import DatasetSpec, EndpointConfig, GenerateConfig, SamplingParams
from aerie.generate.output import read_conversations
from aerie.generate.work import run
from aerie.store import StoreConfig, open_store
from tests.fault_server import FaultServer
from tests.stage_work import dataset_dir

pytestmark = pytest.mark.integration  # a moto S3 server

pytest_plugins = ("tests.s3_support",)


def test_a_second_machine_resumes_from_the_journal_in_s3(s3_config: StoreConfig, tmp_path: Path):
    source = tmp_path / "data.jsonl"
    source.write_text(
        "".join(
            json.dumps({"id": f"s{i}", "conversations": [{"from": "human", "value": f"remote {i}"}]}) + "\n"
            for i in range(6)
        )
    )
    store = open_store(s3_config)
    with FaultServer() as server:
        endpoint = EndpointConfig(base_url=server.url, api_key_env="AERIE_TEST_S3_KEY", concurrency=2)
        spec = DatasetSpec(
            name="toy",
            source=SourceSpec(kind="jsonl", path=str(source)),
            num_samples=3,
            sampling=SamplingParams(max_tokens=8),
        )
        machine_a = GenerateConfig(endpoint=endpoint, work_dir=str(tmp_path / "machine-a"))
        first = run(machine_a, spec, dataset_dir(store, "r", machine_a, spec), base_url=server.url)
        assert first.figures["records"] == 3
        parts = [k for k in store.list("r/generate-toy/journal") if k.rsplit("/", 1)[-1].startswith("part-")]
        assert len(parts) == 1

        # Another machine (nothing in its work dir) asks for more samples: a new stage key, the same
        # journal, so only the three new conversations are generated.
        machine_b = machine_a.model_copy(update={"work_dir": str(tmp_path / "machine-b")})
        bigger = spec.model_copy(update={"num_samples": 6})
        second = run(machine_b, bigger, dataset_dir(store, "r", machine_b, bigger), base_url=server.url)
        assert sorted(s.prompt for s in server.seen) == [f"remote {i}" for i in range(6)]
        assert second.prefix != first.prefix and second.figures["records"] == 6

    local = store.get_file(f"{second.prefix}/conversations.parquet", tmp_path / "out.parquet")
    assert read_conversations(local)["id"].to_list() == [f"s{i}" for i in range(6)]
    assert second.manifest_uri.startswith("s3://")
