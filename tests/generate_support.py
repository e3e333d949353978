"""The generation stage killed mid-run and resumed: a child process running the real `run()`, its journal
read back, and the guarantees a resumed dataset must keep (each record once, in order; the killed run's
work kept, counted and timed), shared by the tests against any endpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from aerie.generate.config import DatasetSpec, GenerateConfig
from aerie.generate.output import read_conversations
from aerie.manifest import StageResult, load_manifest
from aerie.store import LocalStore

REPO = Path(__file__).resolve().parents[1]
CHILD = """
import sys
from aerie.generate.config import DatasetSpec, GenerateConfig
from aerie.generate.work import run
from aerie.store import LocalStore
from tests.stage_work import dataset_dir
cfg = GenerateConfig.model_validate_json(sys.argv[1])
spec = DatasetSpec.model_validate_json(sys.argv[2])
run(cfg, spec, dataset_dir(LocalStore(sys.argv[3]), "r", cfg, spec), base_url=sys.argv[4])
"""


def journal_of(store_root: Path, spec: DatasetSpec) -> Path:
    return store_root / "r" / f"generate-{spec.name}" / "journal"


def journal_lines(journal: Path) -> int:
    return sum(p.read_text().count("\n") for p in journal.rglob("part-*.jsonl")) if journal.exists() else 0


def journal_ids(journal: Path) -> list[str]:
    """The ids of the complete records in the journal's parts (a killed writer may leave a torn line)."""
    return [
        json.loads(line)["id"]
        for p in journal.rglob("part-*.jsonl")
        for line in p.read_text().splitlines()
        if line.endswith("}")
    ]


def kill_mid_run(
    cfg: GenerateConfig,
    spec: DatasetSpec,
    store_root: Path,
    url: str,
    *,
    at_lines: int,
    timeout_s: float = 60,
    while_running: Callable[[subprocess.Popen[bytes]], None] | None = None,
) -> set[str]:
    """Generate in a child process, SIGKILL it once its journal holds `at_lines` records and its first
    time record; the ids it had finished. `while_running(child)` runs just before the kill."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, cfg.model_dump_json(), spec.model_dump_json(), str(store_root), url],
        cwd=REPO,
    )
    journal = journal_of(store_root, spec)
    try:
        deadline = time.monotonic() + timeout_s
        while journal_lines(journal) < at_lines or not list(journal.rglob("time-*.jsonl")):
            assert child.poll() is None, "the child exited before it was killed"
            assert time.monotonic() < deadline, "the child never wrote its journal"
            time.sleep(0.05)
        if while_running is not None:
            while_running(child)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL
    return set(journal_ids(journal))


def check_resumed(
    store: LocalStore, result: StageResult, journal: Path, ids: list[str], done_before: set[str]
) -> None:
    """The re-run's dataset: every record once, in order; the killed run's records counted as done
    earlier; its time added to the re-run's; no id twice in the journal."""
    frame = read_conversations(store.local_path(f"{result.prefix}/conversations.parquet"))
    assert frame["id"].to_list() == ids
    assert result.figures["records"] == len(ids)
    manifest = load_manifest(store, result.prefix)
    assert manifest["counts"]["done_in_earlier_runs"] == len(done_before)
    killed_time, _rerun_time = sorted(journal.rglob("time-*.jsonl"))  # one per run, numbered in order
    killed_s = json.loads(killed_time.read_text())["seconds"]
    throughput = manifest["throughput"]
    assert throughput["runs"] == 2 and killed_s > 0
    assert throughput["wall_seconds"] == pytest.approx(
        throughput["this_run"]["wall_seconds"] + killed_s, abs=0.01
    )
    assert manifest["seconds"] >= killed_s and result.figures["wall_s"] == throughput["wall_seconds"]
    written = journal_ids(journal)
    assert len(written) == len(set(written)) == len(ids)
