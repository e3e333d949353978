"""benchmarks/hostjob.sh, the runner of GPU-host jobs longer than one device call, run for real with bash:
a driver started detached from a private copy of the tree, a failed step re-run by the next `go` from that
call's tree while finished steps are skipped, and the job's files copied back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.integration

DRIVER = """\
step first bash -c 'echo run >> "$JOB_WORK/first.count"'
step second bash -c '[ -f "$CALL_TREE/fixed" ] && echo "$X" > "$JOB_WORK/out.txt"'
"""


def make_tree(tmp_path: Path) -> Path:
    """A working tree as a device call brings it: hostjob.sh, tools.gpuhost (its env command) and a job."""
    tree = tmp_path / "tree"
    (tree / "benchmarks" / "job").mkdir(parents=True)
    shutil.copy(REPO / "benchmarks" / "hostjob.sh", tree / "benchmarks")
    shutil.copytree(REPO / "tools", tree / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "benchmarks" / "job" / "driver.sh").write_text(DRIVER)
    (tree / "benchmarks" / "job" / "h200.env").write_text("X=from-plan\n")
    (tree / "benchmarks" / "job" / "back.txt").write_text("out.txt\n")
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
        ["bash", "benchmarks/hostjob.sh", "benchmarks/job", "go", "60"],
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
