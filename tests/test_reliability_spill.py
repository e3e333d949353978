"""A merge killed by SIGKILL cannot remove its spill folder; the next run recognises it by its name (this
machine, a process no longer running) and removes it, leaving the folders of running processes and of
other machines alone. A real merge in a child process, a real SIGKILL, a real re-run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from aerie.corpus import work
from aerie.corpus.config import CorpusConfig
from aerie.store import LocalStore
from aerie.workdirs import host_tag, process_start, sweep_stale
from tests.corpus_support import generated_result, msg
from tests.stage_work import staged

run = staged("merge", work.run)

pytestmark = pytest.mark.integration  # a child process

REPO = Path(__file__).resolve().parents[1]
# The merge in a child process; its progress callback holds it once the first shard is written (the
# rest still spilled on disk), so the kill lands mid-merge and not after it.
CHILD = """
import json, sys, time
from aerie.corpus import work
from aerie.corpus.config import CorpusConfig
from aerie.manifest import StageResult
from aerie.store import LocalStore
from aerie.targets import resolve_target
from tests.stage_work import staged

run = staged("merge", work.run)

def hold(fraction, message):
    if message.startswith("wrote "):
        print("HELD", flush=True)
        time.sleep(600)

store = LocalStore(sys.argv[1])
inputs = [StageResult.model_validate(json.loads(sys.argv[2]))]
cfg = CorpusConfig.model_validate(json.loads(sys.argv[3]))
run(cfg, store=store, run_name="r", target=resolve_target("smollm2-135m-instruct"), inputs=inputs, progress=hold)
"""


def rows(n: int) -> list[dict]:
    return [
        {
            "id": f"g{i}",
            "source": "gen",
            "messages": [msg("user", f"Question {i}?"), msg("assistant", f"Answer number {i}.")],
            "finish_reasons": ["stop"],
        }
        for i in range(n)
    ]


def owned_folders(tmp: Path) -> list[Path]:
    return sorted(p for p in tmp.iterdir() if p.name.startswith("aerie-merge-"))


def test_a_merge_killed_mid_run_leaves_a_spill_the_next_run_removes(
    smollm2, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    store = LocalStore(tmp_path / "store")
    upstream = generated_result(store, "r", "gen", rows(40))
    cfg = CorpusConfig(num_workers=1, rows_per_shard=8, eval_fraction=0.0)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, store.root, upstream.model_dump_json(), cfg.model_dump_json()],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)},
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "HELD", "the merge never reached its first shard"
        [left] = owned_folders(tmp)
        assert list((left / "spill").glob("*.arrow")), "nothing spilled: the kill would prove nothing"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    assert owned_folders(tmp) == [left]  # SIGKILL: nothing could remove it

    # Folders the sweep must leave: this (running) process's, and another machine's.
    me = tmp / f"aerie-merge-{host_tag()}-{os.getpid()}-{process_start(os.getpid())}-mine"
    elsewhere = tmp / f"aerie-merge-00000000-{child.pid}-1-other"
    for keep in (me, elsewhere):
        keep.mkdir()

    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    result = run(cfg, store=store, run_name="r", target=smollm2, inputs=[upstream])
    assert result.figures["records"] == result.figures["input_rows"] == 40  # the merge finished, whole
    assert not left.exists()
    assert me.exists() and elsewhere.exists()
    assert owned_folders(tmp) == sorted([me, elsewhere])  # the re-run removed its own folder too


def test_a_reused_pid_does_not_keep_a_dead_owners_folder(tmp_path: Path):
    """A folder whose pid now belongs to another process (another start time) is stale all the same."""
    pid = os.getpid()
    reused = tmp_path / f"aerie-merge-{host_tag()}-{pid}-{(process_start(pid) or 0) + 1}-old"
    reused.mkdir()
    (reused / "spill").mkdir()
    assert sweep_stale(tmp_path) == [reused]
    assert not reused.exists()
