"""The extraction flow under a real Prefect test server: a disk shortage fails in the stage's preflight
before any server starts; a small corpus goes through a real reference server into shards, with the
figures table and progress artifact, and the second flow run is a cache hit."""

from __future__ import annotations

import asyncio

import pytest
from prefect.client.orchestration import get_client

from aerie.config import PipelineConfig
from aerie.errors import PreflightError
from aerie.extract.config import ExtractConfig
from aerie.serving import ServerConfig
from aerie.stage import Upstream
from aerie.store import StoreConfig, open_store
from flows.stage import run_stage
from tests.conftest import free_port
from tests.extract_support import corpus_rows, write_corpus

pytest_plugins = ("tests.prefect_support",)
# integration: a Prefect test server and reference server processes (one harness for every flow module)
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("prefect_harness")]


@pytest.fixture
def corpus(tmp_path, smollm2):
    store_cfg = StoreConfig(uri=str(tmp_path / "store"))
    rows = corpus_rows(smollm2.load_tokenizer(), 6, seed=3)
    return store_cfg, write_corpus(open_store(store_cfg), "f", {"train": rows[:5], "eval": rows[5:]})


def test_flow_refuses_in_preflight_without_launching(tmp_path, smollm2, corpus):
    store_cfg, result = corpus
    port = free_port()
    cfg = ExtractConfig(work_dir=str(tmp_path / "work"), disk_margin=1e12)
    pipeline = PipelineConfig(
        run="f", store=store_cfg, extract=cfg, server=ServerConfig(device="cpu", port=port)
    )
    with pytest.raises(PreflightError, match="not enough disk for extraction"):
        run_stage("extract", pipeline, smollm2, Upstream().plus("merge", [result]))
    assert not list((tmp_path / "work").rglob("*.log"))  # no server log: nothing was launched


def _check_phases(phases: dict) -> None:
    """The steady wall splits into the client's phases (its own time is `other`), and the server's
    phases over the same windows cover its model thread's time."""
    wall, client, server = phases["wall_s"], phases["client"], phases["server"]
    assert wall > 0 and set(client) == {
        "queued", "http_wait", "dump_wait", "read_dumps", "check", "commit", "other",
    }  # fmt: skip
    assert all(p["s"] >= 0 for name, p in client.items() if name != "other")
    named = sum(p["s"] for name, p in client.items() if name != "other")
    assert 0.5 * wall <= named <= wall + 0.01  # other >= 0: no wait counted twice
    assert abs(sum(p["share"] for p in client.values()) - 1) < 0.01
    assert client["http_wait"]["s"] > 0 and client["read_dumps"]["s"] > 0 and client["commit"]["s"] > 0
    assert server is not None and all(p["s"] >= 0 for p in server.values())
    assert server["forward"]["s"] > 0 and server["dump_write"]["s"] > 0
    window = phases["server_window_s"]
    assert 0 < window <= wall * 1.01
    thread = sum(server[k]["s"] for k in ("idle", "write_slot_wait", "capture", "generate"))
    assert 0.5 * window <= thread <= window * 1.01


async def _artifact_keys() -> set[str]:
    async with get_client() as client:
        return {a.key for a in await client.read_artifacts() if a.key}


@pytest.mark.slow
def test_flow_extracts_and_caches(tmp_path, smollm2, corpus):
    store_cfg, result = corpus
    cfg = PipelineConfig(
        run="f",
        store=store_cfg,
        extract=ExtractConfig(work_dir=str(tmp_path / "work"), shard_bytes=1 << 20, batch_tokens=256),
        server=ServerConfig(device="cpu", port=free_port()),
    )
    upstream = Upstream().plus("merge", [result])
    (first,) = run_stage("extract", cfg, smollm2, upstream)
    assert not first.cache_hit
    assert first.figures["tokens"] == result.figures["tokens"] and first.figures["canary_passed"]
    _check_phases(first.figures["phases"])
    # One request, one pack: the reference server was told the request size (its default is 16,384).
    (log,) = (tmp_path / "work").rglob("server-s0-0.log")
    assert "max_prefill_tokens=256," in log.read_text()
    keys = asyncio.run(_artifact_keys())
    assert "f-extract" in keys and "extract-figures" in keys
    (second,) = run_stage("extract", cfg, smollm2, upstream)
    assert second.manifest_sha256 == first.manifest_sha256
