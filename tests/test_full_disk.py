"""A disk that refuses a write mid-run, for real: `aerie run` (the CLI, in a child process) runs the tiny
pipeline under a file-size limit (RLIMIT_FSIZE) that makes the kernel refuse any write past 400 KB with
EFBIG ("File too large"). A full disk refuses the same write() with ENOSPC; mounting a small filesystem
to get that would need root, and no code path here tells the two errnos apart.

Generation and merge write small files and finish; the extraction server's first hidden-state dump is
larger (the canary's sample, ~100 tokens x 4.6 KB) and is refused. The run must stop with an error that
says what and where (the dump's path, the room left there), keep the finished stages, and a re-run
without the limit must take them as cache hits and extract every token."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from pathlib import Path

from aerie.config import apply_overrides
from aerie.pipeline import run_pipeline
from aerie.presets import get_preset
from aerie.progress import no_progress
from tests import pipeline_support
from tests.conftest import free_port

LIMIT_BYTES = 400_000


def _limited() -> None:
    """In the child: a write past the limit fails with EFBIG instead of killing it with SIGXFSZ."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT_BYTES, LIMIT_BYTES))


def test_a_refused_write_stops_the_run_clearly_and_the_rerun_resumes(tmp_path, smollm2):
    overrides = [
        *pipeline_support.tiny_overrides(tmp_path / "store", run="full", port=free_port()),
        f"extract.work_dir={tmp_path / 'work'}",
    ]
    aerie = Path(sys.executable).parent / "aerie"
    done = subprocess.run(
        [str(aerie), "run", "smollm2-local", *overrides, "--until", "extract"],
        preexec_fn=_limited,
        capture_output=True,
        text=True,
        timeout=600,
    )
    error = [
        line for line in done.stderr.replace("\r", "\n").splitlines() if line.startswith("aerie: error:")
    ]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(error) == 1, done.stderr[-3000:]  # one line, its own: not trailing a progress bar
    assert "cannot write the dump " in error[0] and ".safetensors" in error[0]
    assert "GiB free there" in error[0] and "File too large" in error[0]

    # What finished is kept: the re-run takes generation and merge as they are and extracts everything.
    cfg = apply_overrides(get_preset("smollm2-local"), overrides)
    report = run_pipeline(cfg, until="extract", progress=lambda stage: no_progress)
    by_stage = {r.stage: r for r in report.results}
    assert by_stage["generate-sharegpt"].cache_hit and by_stage["merge"].cache_hit
    extract = by_stage["extract"]
    assert not extract.cache_hit and extract.figures["canary_passed"] is True
    assert extract.figures["tokens"] == by_stage["merge"].figures["tokens"] > 0
