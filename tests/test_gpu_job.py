"""benchmarks/gpu/job.sh, the driver of GPU-host jobs, run for real with bash: a job longer than one device
call (`go`) has its driver started detached from a private copy of the tree, a failed step re-run by the
next `go` from that call's tree while finished steps are skipped, and the job's files copied back; every
job file names itself in `list`, and each kind of job refuses the other's verb."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration

JOB = """\
# job (go): a test job
BACK_FILES="out.txt"
plan_h200() { X=from-plan; }
steps() {
  step first bash -c 'echo run >> "$JOB_WORK/first.count"'
  step second bash -c '[ -f "$CALL_TREE/fixed" ] && echo "$X" > "$JOB_WORK/out.txt"'
}
"""


def make_tree(tmp_path: Path) -> Path:
    """A working tree as a device call brings it: job.sh, tools.gpuhost (its env command) and a job."""
    tree = tmp_path / "tree"
    (tree / "benchmarks" / "gpu" / "jobs").mkdir(parents=True)
    shutil.copy(REPO / "benchmarks" / "gpu" / "job.sh", tree / "benchmarks" / "gpu")
    shutil.copytree(REPO / "tools", tree / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "benchmarks" / "gpu" / "jobs" / "job.sh").write_text(JOB)
    return tree


def go(tree: Path, tmp_path: Path) -> str:
    env = {
        **os.environ,
        "JOB_WORK": str(tmp_path / "work"),
        "JOB_HOME": str(tmp_path / "home"),
        "BACK": str(tmp_path / "back"),
        "PY": sys.executable,
    }
    done = subprocess.run(
        ["bash", "benchmarks/gpu/job.sh", "go", "job", "60"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_failed_step_is_run_again_by_the_next_go_and_finished_ones_are_not(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    work = tmp_path / "work"

    first = go(tree, tmp_path)
    assert "== second FAILED with 1" in first
    assert "DRIVER STOPPED" in first
    assert (work / "failed.second").is_file() and not (work / "out.txt").exists()

    (tree / "fixed").touch()  # the fix the next call's tree brings
    second = go(tree, tmp_path)
    assert "ALL DONE" in second
    assert (work / "first.count").read_text() == "run\n"  # the finished step was skipped
    assert (work / "out.txt").read_text() == "from-plan\n"  # the plan's settings reached the step
    assert (tmp_path / "back" / "out.txt").read_text() == "from-plan\n"
    assert "== second done" in (tmp_path / "back" / "driver-tail.log").read_text()
    assert float((work / "seconds.second").read_text()) >= 0

    third = go(tree, tmp_path)  # a finished job is not started again
    assert "ALL DONE" in third and "driver started" not in third
    assert (work / "first.count").read_text() == "run\n"


def test_every_job_is_listed_and_of_one_kind() -> None:
    """`list` prints each job file's first line; a job defines `run` (one call) or `steps` (several)."""
    jobs = sorted(p.stem for p in (REPO / "benchmarks" / "gpu" / "jobs").glob("*.sh"))
    listed = subprocess.run(
        ["bash", "benchmarks/gpu/job.sh", "list"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert [line.split()[0] for line in listed] == jobs
    for name in jobs:
        text = (REPO / "benchmarks" / "gpu" / "jobs" / f"{name}.sh").read_text()
        assert ("\nrun() {" in text) != ("\nsteps() {" in text), name
        wrong = ["go", name, "1"] if "\nrun() {" in text else [name]
        done = subprocess.run(
            ["bash", "benchmarks/gpu/job.sh", *wrong], cwd=REPO, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 64, (name, done.stdout, done.stderr)
