"""A disk that refuses a write mid-run, for real: `aerie run` (the CLI, in a child process) runs the tiny
pipeline under a file-size limit (RLIMIT_FSIZE) that makes the kernel refuse writes past N bytes with
EFBIG ("File too large"). A full disk refuses the same write() with ENOSPC; mounting a small filesystem
to get that would need root, and no code path here tells the two errnos apart.

- extraction: generation and merge write small files and finish; the server's first hidden-state dump
  (the canary's sample, ~100 tokens x 4.6 KB) passes 400 KB and is refused;
- generation: the journal's part file passes 3,000 bytes after a few conversations;
- training: the drafter's weights pass 2 MB, every file before them is smaller.

Each run must stop with one error line that says what and where, keep what finished, and a re-run
without the limit must resume from it (cache hits; the journaled conversations not generated again)."""

from __future__ import annotations

import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from aerie.config import apply_overrides
from aerie.generate.journal import read_jsonl
from aerie.manifest import StageResult
from aerie.pipeline import run_pipeline
from aerie.presets import get_preset
from aerie.progress import no_progress
from tests import pipeline_support
from tests.conftest import free_port

pytestmark = pytest.mark.integration  # `aerie run` as a child process


def _run_limited(overrides: list[str], until: str, limit: int) -> str:
    """`aerie run ... --until STAGE` in a child whose writes past `limit` bytes fail with EFBIG (not
    SIGXFSZ); returns its one error line, after checking the exit code and that nothing else went
    wrong loudly (no traceback from a thread)."""

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    aerie = Path(sys.executable).parent / "aerie"
    done = subprocess.run(
        [str(aerie), "run", "smollm2-local", *overrides, "--until", until],
        preexec_fn=limited,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = done.stderr.replace("\r", "\n").splitlines()
    error = [line for line in lines if line.startswith("aerie: error:")]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(error) == 1, done.stderr[-3000:]  # one line, its own: not trailing a progress bar
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "File too large" in error[0]
    return error[0]


def _overrides(tmp_path: Path) -> list[str]:
    return [
        *pipeline_support.tiny_overrides(tmp_path / "store", run="full", port=free_port()),
        f"extract.work_dir={tmp_path / 'work'}",
        f"train.cache_dir={tmp_path / 'train-cache'}",
    ]


def _rerun(overrides: list[str], until: str) -> dict[str, StageResult]:
    cfg = apply_overrides(get_preset("smollm2-local"), overrides)
    report = run_pipeline(cfg, until=until, progress=lambda stage: no_progress)
    return {r.stage: r for r in report.results}


def test_a_refused_dump_stops_extraction_clearly_and_the_rerun_resumes(tmp_path, smollm2):
    overrides = _overrides(tmp_path)
    error = _run_limited(overrides, "extract", 400_000)
    # The server's reply, carried into the canary's error: the dump file it could not write, and the room.
    assert "canary" in error and re.search(
        r"cannot write /\S+\.safetensors \(\d+\.\d\d GiB free there\)", error
    )

    # What finished is kept: the re-run takes generation and merge as they are and extracts everything.
    by_stage = _rerun(overrides, "extract")
    assert by_stage["generate-sharegpt"].cache_hit and by_stage["merge"].cache_hit
    extract = by_stage["extract"]
    assert not extract.cache_hit and extract.figures["canary_passed"] is True
    assert extract.figures["tokens"] == by_stage["merge"].figures["tokens"] > 0


def test_a_refused_journal_write_stops_generation_clearly_and_the_rerun_resumes(tmp_path, smollm2):
    # 3,000 bytes hold a few conversations of the journal's first part: the next write is refused.
    overrides = _overrides(tmp_path)
    error = _run_limited(overrides, "generate", 3_000)
    journal = tmp_path / "store" / "full" / "generate-sharegpt" / "journal"
    assert f"cannot write the generation journal in {journal}" in error
    parts = list(journal.glob("*/part-*.jsonl"))
    assert len(parts) == 1 and parts[0].stat().st_size == 3_000  # the records before it stay
    kept = list(read_jsonl(parts[0]))  # its torn last line dropped
    assert 0 < len(kept) < 6

    # The re-run generates only what the journal lacks, in a part of its own: no conversation twice.
    result = _rerun(overrides, "generate")["generate-sharegpt"]
    assert not result.cache_hit and result.figures["records"] == 6 and result.figures["failed"] == 0
    later = [r for p in journal.glob("*/part-*.jsonl") if p != parts[0] for r in read_jsonl(p)]
    assert len(kept) + len(later) == 6


def test_a_refused_checkpoint_write_stops_training_clearly_and_the_rerun_trains(tmp_path, smollm2):
    # 2 MB pass every file before training (the largest, a shard, is < 1 MB); the drafter's weights
    # (a 32,000-row lm_head in fp32) do not.
    overrides = _overrides(tmp_path)
    error = _run_limited(overrides, "train", 2_000_000)
    assert f"cannot write {tmp_path / 'train-cache'}" in error and "GiB free there" in error

    by_stage = _rerun(overrides, "train")
    assert all(by_stage[s].cache_hit for s in ("generate-sharegpt", "merge", "extract"))
    assert not by_stage["train"].cache_hit and by_stage["train"].figures["steps"] > 0
