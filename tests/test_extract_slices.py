"""Extraction fanned out over hosts: one slice per call, each with its own servers (real reference server
processes), its own progress object and its record; `assemble` builds the manifest from the records.

1. Library: two slices run at the same time (two threads standing in for two hosts) against one store,
   a missing slice record makes `assemble` refuse naming it, a re-run slice resumes without launching,
   the assembled stage holds exactly the corpus and the very shards a single host with two servers
   writes (same stage key), and re-runs are no-ops.
2. Prefect: `prefect deploy` of `extract-slice/slice-local` to a real Prefect server, a process worker, and the
   extract stage's flow fanning out over it with `run_deployment`, then assembling.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client

from aerie.config import PipelineConfig
from aerie.errors import ConfigError, ExtractionError
from aerie.extract import slices, work
from aerie.extract.config import ExtractConfig
from aerie.extract.corpus_rows import slice_bounds
from aerie.extract.phases import PhaseTotals
from aerie.extract.resume import ProgressFile
from aerie.extract.slices import SliceMissingError, SliceRecord, record_name
from aerie.extract.stage import EXTRACT
from aerie.manifest import StageResult, load_manifest
from aerie.serving import ServerConfig
from aerie.stage import StageContext, Upstream
from aerie.store import LocalStore, StoreConfig, open_store
from flows.stage import run_stage
from tests.extract_support import corpus_rows, write_corpus
from tests.processes import free_port_pair
from tests.stage_work import staged
from tests.test_extract_server import check_commit_path
from tests.test_pipeline import BIN, REPO

run, run_slice, assemble = (staged("extract", f) for f in (work.run, slices.run_slice, slices.assemble))


def stage_run(
    cfg: ExtractConfig, *, store, run_name, target, corpus, server, rebuild_missing=False
) -> StageResult:
    """The extraction stage as the pipeline runs it: its slices as parts here, then assembled."""
    pipeline = PipelineConfig(run=run_name, extract=cfg, server=server)
    ctx = StageContext(store=store, run=run_name, target=target, rebuild_missing=rebuild_missing)
    (result,) = EXTRACT.run(EXTRACT.job(pipeline, ctx, Upstream().plus("merge", [corpus])))
    return result


pytestmark = pytest.mark.integration  # reference server processes

pytest_plugins = ("tests.prefect_support",)  # prefect_api: the real Prefect server

LAYOUT = ("split", "slice", "index", "name", "first_row", "end_row", "samples", "tokens", "bytes")


def _corpus(store: LocalStore, tokenizer, n: int) -> tuple[dict[str, list[dict]], object]:
    rows = corpus_rows(tokenizer, n, seed=5, min_words=6, max_words=20)
    splits = {"train": rows[: n - 3], "eval": rows[n - 3 :]}
    return splits, write_corpus(store, "s", splits, rows_per_shard=6)


def _cfg(tmp_path: Path, **update) -> ExtractConfig:
    return ExtractConfig(
        shard_bytes=1 << 18,  # a few samples per shard
        batch_tokens=128,
        work_dir=str(tmp_path / "work"),
        canary_reference="never",  # the numeric canary is covered by test_extract_server
        dump_timeout_s=60,
        **update,
    )


def _layout(manifest: dict) -> dict[str, list[tuple]]:
    return {
        split: [tuple(s[f] for f in LAYOUT) for s in body["shards"]]
        for split, body in manifest["splits"].items()
    }


@pytest.mark.slow
def test_slices_run_apart_and_assemble_into_the_single_host_stage(tmp_path, smollm2):
    store = LocalStore(tmp_path / "store")
    splits, corpus = _corpus(store, smollm2.load_tokenizer(), 14)
    corpus_tokens = sum(len(r["input_ids"]) for rs in splits.values() for r in rs)
    # Two servers start at once beside the suite's other workers on two cores: one can outrun the default
    # deadline; what is tested here is how slices split and assemble, not how fast a server starts.
    server = ServerConfig(backend="reference", device="cpu", port=free_port_pair(), startup_timeout_s=600)
    cfg = _cfg(tmp_path, num_slices=2)
    common = {"store": store, "run_name": "s", "target": smollm2, "corpus": corpus, "server": server}
    logs = tmp_path / "work"

    # Two hosts at once: each slice writes only its own progress object.
    with ThreadPoolExecutor(2) as pool:
        records = list(pool.map(lambda k: run_slice(cfg, k, **common), [0, 1]))
    assert [r.servers for r in records] == [[0], [1]]
    assert all(r.canary is not None and r.tokens > 0 for r in records)
    # Each record keeps its slice's phases, the commit path's busy seconds among them, as they were.
    for r in records:
        assert r.phases is not None and r.phases["commit_path"]["write"] > 0
        assert PhaseTotals.from_record(r.phases).record() == r.phases
    prefix = next(iter({k.rsplit("/slices/", 1)[0] for k in store.list("s/extract") if "/slices/" in k}))
    assert not store.exists(f"{prefix}/progress.json")
    for k, record in enumerate(records):
        progress = ProgressFile(store, f"{prefix}/slices/slice-{k}-of-2.progress.json").shards
        assert {s.slice for s in progress} == {k}
        assert sorted(s.name for s in progress) == sorted(s["name"] for s in record.shards)

    # A slice whose record is missing: assemble refuses, naming it (and only it).
    store.delete(f"{prefix}/{record_name(1, 2)}")
    with pytest.raises(SliceMissingError, match=r"not finished: slice 1 of 2 \(") as err:
        assemble(cfg, **common)
    assert "slice 0" not in str(err.value) and isinstance(err.value, ExtractionError)
    # Re-running it resumes from its progress object: every shard is kept, no server is launched.
    launched = len(list(logs.rglob("server-*.log")))
    again = run_slice(cfg, 1, **common)
    assert again.tokens == 0
    assert again.resumed_rows == sum(
        hi - lo for rs in splits.values() for lo, hi in [slice_bounds(len(rs), 2)[1]]
    )
    assert sorted(s["name"] for s in again.shards) == sorted(s["name"] for s in records[1].shards)
    assert len(list(logs.rglob("server-*.log"))) == launched

    result = assemble(cfg, **common)
    assert not result.cache_hit
    assert result.figures["tokens"] == corpus_tokens
    assert result.figures["samples"] == sum(len(rs) for rs in splits.values())
    # The slices' records carry their phases: the assembled figures say where the time went.
    phases = result.figures["phases"]
    assert phases["client"]["http_wait"]["s"] > 0 and phases["server"]["forward"]["s"] > 0
    check_commit_path(phases)
    manifest = load_manifest(store, result.prefix)
    assert manifest["server"]["num_slices"] == 2 and [s["slice"] for s in manifest["slices"]] == [0, 1]

    # Re-runs are no-ops: a finished slice returns its record untouched, assemble is a cache hit, and
    # so is the in-process stage with the same config.
    record0 = store.get_bytes(f"{prefix}/{record_name(0, 2)}")
    assert run_slice(cfg, 0, **common) == records[0]
    assert store.get_bytes(f"{prefix}/{record_name(0, 2)}") == record0
    assert len(list(logs.rglob("server-*.log"))) == launched
    assert assemble(cfg, **common).cache_hit
    assert stage_run(cfg, **common).manifest_sha256 == result.manifest_sha256
    with pytest.raises(ConfigError, match="num_slices=2: slices run as the extraction stage's parts"):
        run(cfg, **common)  # one host's work function is no fan-out

    # A shard of slice 1 is gone (a GPU host restores manifests, never shards): a plain run is still a
    # hit, a rebuilding run extracts that slice again, byte for byte, and leaves slice 0 alone.
    lost = f"{prefix}/{records[1].shards[0]['path']}"
    lost_bytes = store.get_bytes(lost)
    store.delete(lost)
    assert stage_run(cfg, **common).cache_hit and not store.exists(lost)
    rebuilt = stage_run(cfg, **common, rebuild_missing=True)
    assert not rebuilt.cache_hit and rebuilt.figures["tokens"] == corpus_tokens
    assert store.get_bytes(lost) == lost_bytes
    assert store.get_bytes(f"{prefix}/{record_name(0, 2)}") == record0
    redone = SliceRecord.model_validate_json(store.get_bytes(f"{prefix}/{record_name(1, 2)}"))
    assert 0 < redone.tokens < corpus_tokens  # slice 1 ran again, resuming after its shards still there
    assert stage_run(cfg, **common, rebuild_missing=True).cache_hit  # nothing missing: nothing to do

    # One host with two servers: the same stage key and the very same shards.
    single_store = LocalStore(tmp_path / "single")
    _, single_corpus = _corpus(single_store, smollm2.load_tokenizer(), 14)
    assert single_corpus.manifest_sha256 == corpus.manifest_sha256
    # (3 commit threads per server where the slices had this host's default: shards do not depend on it)
    single_cfg = _cfg(tmp_path / "one", num_servers=2, commit_workers=3)
    single = run(single_cfg, **{**common, "store": single_store, "corpus": single_corpus})
    assert single.key == result.key and single.figures["tokens"] == corpus_tokens
    assert _layout(load_manifest(single_store, single.prefix)) == _layout(manifest)


# ---- the fan-out through a Prefect deployment ------------------------------------------------------


async def _slice_runs(prefix: str) -> list:
    async with get_client() as client:
        runs = await client.read_flow_runs()
    return sorted((r for r in runs if r.name.startswith(prefix)), key=lambda r: r.name)


@pytest.mark.slow
def test_extract_flow_fans_out_over_the_slice_deployment(prefect_api, tmp_path, smollm2):
    env = {**prefect_api["env"], "PREFECT_WORKER_QUERY_SECONDS": "2"}

    def cli(*args: str) -> None:
        out = subprocess.run(
            [str(BIN / "prefect"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
        )
        assert out.returncode == 0, f"prefect {' '.join(args)}:\n{out.stdout}\n{out.stderr}"

    cli("work-pool", "create", "aerie-local", "--type", "process", "--overwrite")
    cli("--no-prompt", "deploy", "--name", "local", "--name", "slice-local")  # the pipeline and the slice
    store_cfg = StoreConfig(uri=str(tmp_path / "store"))
    store = open_store(store_cfg)
    splits, corpus = _corpus(store, smollm2.load_tokenizer(), 8)
    server = ServerConfig(backend="reference", device="cpu", port=free_port_pair())
    upstream = Upstream().plus("merge", [corpus])

    def extract_flow(cfg: ExtractConfig, run_name: str) -> StageResult:
        pipeline = PipelineConfig(run=run_name, store=store_cfg, extract=cfg, server=server)
        (result,) = run_stage("extract", pipeline, smollm2, upstream)
        return result

    fan_out = {"num_slices": 2, "slice_deployment": "extract-slice/slice-local"}
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            [str(BIN / "prefect"), "worker", "start", "--pool", "aerie-local"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # A slice that cannot run (its host's disk preflight refuses): the parent names it and its run.
        with pytest.raises(ExtractionError, match=r"slice 0 of 2 \(flow run 'short-slice-0-of-2', ") as err:
            extract_flow(cfg=_cfg(tmp_path, disk_margin=1e12, **fan_out), run_name="short")
        assert "slice 1 of 2 (flow run 'short-slice-1-of-2'" in str(err.value)
        assert "not enough disk" in str(err.value)

        result = extract_flow(cfg=_cfg(tmp_path, **fan_out), run_name="s")
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a loaded machine: the worker's shutdown is not under test
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=30)
    assert result.figures["tokens"] == sum(len(r["input_ids"]) for rs in splits.values() for r in rs)
    manifest = load_manifest(store, result.prefix)
    assert manifest["server"]["num_slices"] == 2 and [s["servers"] for s in manifest["slices"]] == [[0], [1]]
    runs = asyncio.run(_slice_runs("s-slice-"))
    assert [r.name for r in runs] == ["s-slice-0-of-2", "s-slice-1-of-2"], log.read_text()[-3000:]
    assert all(r.state.is_completed() and r.parent_task_run_id is not None for r in runs)  # subflows
