"""The plan-validate job's checks (benchmarks/gpu/jobs/plan-validate.sh) and what it writes: a validation
run is never a calibration run's config, a stage doing a calibration run's work is left out, and the rows it
appends are quoted in the READMEs and docs/plan.md in a form scripts/check_figures.py accepts (on planted copies of the READMEs and the record).
The run itself takes minutes and is made by hand (docs/plan.md says how)."""

from __future__ import annotations

import copy
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "planner"))

import plan_accuracy  # noqa: E402  (a script: its folder is on sys.path)

from aerie.plan import make_plan  # noqa: E402
from aerie.presets import load_config  # noqa: E402
from tests.test_figures import checker  # noqa: E402


def script_default() -> list[str]:
    """The overrides the plan-validate job runs without arguments."""
    text = (ROOT / "benchmarks" / "gpu" / "jobs" / "plan-validate.sh").read_text()
    found = re.search(r"^\s*DEFAULT_OVERRIDES=\(([^)]*)\)", text, re.M)
    assert found, "plan-validate.sh sets no DEFAULT_OVERRIDES=(...)"
    return found.group(1).split()


@pytest.mark.parametrize("overrides", [[], *plan_accuracy.CALIBRATION_RUNS])
def test_a_calibration_runs_config_is_refused(overrides: list[str]) -> None:
    with pytest.raises(SystemExit, match="the config of a calibration run"):
        plan_accuracy.same_work_stages("smollm2-local", overrides)


def test_stages_doing_a_calibration_runs_work_are_left_out() -> None:
    size_only = ["generate.datasets.0.num_samples=20", "train.epochs=16"]
    assert plan_accuracy.same_work_stages("smollm2-local", size_only) == ["evaluate", "deploy"]
    assert plan_accuracy.same_work_stages("smollm2-local", script_default()) == []


def written_lines(text: str) -> set[int]:
    """The line numbers plan_quotes writes: the README's headline row, the lines between its markers."""
    lines, inside, out = text.splitlines(), False, set()
    for i, line in enumerate(lines, 1):
        inside = inside or line.startswith("<!-- plan-accuracy: written by")
        if inside or line.startswith("| `aerie plan`'s stage estimates"):
            out.add(i)
        inside = inside and not line.startswith("<!-- end of plan-accuracy")
    return out


def unmarked(text: str) -> str:
    """The page as a reader sees it: the comments naming each figure's key left out."""
    return re.sub(r"<!--.*?-->", "", text)


@pytest.mark.integration  # the check runs git log for the commits the other rows name
def test_quoted_validation_rows_pass_the_figure_check(tmp_path: Path) -> None:
    """A planted validation run (its estimates the script's default plan, its actuals made up) is written
    into copies of README.md, benchmarks/README.md and docs/plan.md, and the READMEs' tables resolve
    to the record."""
    for rel in ("README.md", "benchmarks/README.md", "docs/plan.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "results")
    record = json.loads((ROOT / "benchmarks" / "results" / "plan-accuracy.json").read_text())
    record["validation"] = []  # the planted run's rows alone, whatever validation runs the record holds
    plan = make_plan(load_config("smollm2-local", script_default()), "cpu")
    run = {"start": "2026-01-02T03:04:05Z", "end": "2026-01-02T03:09:05Z", "model_commit": "0123456789abcdef"}
    load = {"samples": 60, "load_1m_mean": 0.31, "load_1m_max": 1.07, "cores": 2}
    for i, est in enumerate(plan.stages):
        actual = round(est.seconds * (1.1 + 0.1 * i), 1)  # planted: a miss that grows stage by stage
        record["validation"].append(
            {
                "preset": "smollm2-local " + " ".join(script_default()),
                "hardware": "cpu",
                "run": run,
                "load_while_running": load,
                "stage": est.stage,
                "unit": "seconds",
                "estimate": round(est.seconds, 1),
                "actual": actual,
                "error": round(est.seconds / actual - 1, 3),
                "estimate_after_merge": None,
            }
        )
    record["validation_summary"] = plan_accuracy.summary(record["validation"])
    (tmp_path / "results" / "plan-accuracy.json").write_text(json.dumps(record))

    plan_accuracy.quote(copy.deepcopy(record), "plan-accuracy.json", tmp_path)

    check = checker()
    for rel in ("README.md", "benchmarks/README.md", "docs/plan.md"):
        written = written_lines((tmp_path / rel).read_text())
        problems = list(check.check_file(tmp_path / rel, root=tmp_path, results=tmp_path / "results"))
        assert [p for p in problems if p[0] in written] == [], f"{rel}: {problems}"
    readme = unmarked((tmp_path / "README.md").read_text())
    summary = record["validation_summary"]
    assert f"{summary['within_25_percent']} of {summary['rows']} within `25%`" in readme
    docs = unmarked((tmp_path / "docs" / "plan.md").read_text())
    assert "None is recorded yet" not in docs
    for r in record["validation"]:
        assert f"| {r['stage']} | {r['estimate']:.1f} s | {r['actual']:.1f} s |" in docs
    # Written again from the same record, nothing changes: the sections are replaced, not appended to.
    before = {
        rel: (tmp_path / rel).read_text() for rel in ("README.md", "benchmarks/README.md", "docs/plan.md")
    }
    plan_accuracy.quote(copy.deepcopy(record), "plan-accuracy.json", tmp_path)
    assert before == {rel: (tmp_path / rel).read_text() for rel in before}
