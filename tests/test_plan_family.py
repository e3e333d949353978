"""`aerie plan`'s drafter-family recommendation: its figures are its records', and the plan prints it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aerie.plan import make_plan
from aerie.plan.facts import figure_at
from aerie.plan.family import evidence, lines
from aerie.plan.render import table
from aerie.presets import load_config

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.mark.parametrize("entry", evidence()["evidence"], ids=lambda e: e["key"])
def test_every_family_figure_is_its_records(entry: dict) -> None:
    record = json.loads((RESULTS / entry["source"]).read_text())
    assert figure_at(record, entry["path"]) == entry["value"], (
        f"{entry['key']} differs from {entry['source']}"
    )


def test_the_recommendation_is_the_family_ahead_on_record() -> None:
    data = evidence()
    figures = {e["key"]: e["value"] for e in data["evidence"]}
    ahead = max(("eagle3", "dflash"), key=lambda f: figures[f"{f}_mtbench"])
    assert data["recommended"] == ahead


def test_the_plan_prints_the_recommendation_and_flags_the_other_family() -> None:
    cfg = load_config("smollm2-local", [])
    text = table(make_plan(cfg))
    assert "drafter family: eagle3 (as recommended)" in text
    figures = {e["key"]: e["value"] for e in evidence()["evidence"]}
    assert f"MT-Bench {figures['dflash_mtbench']:.2f}" in text
    other = lines(load_config("smollm2-local", ["train.drafter=dflash", "deploy.enabled=false"]))
    assert other[1] == "drafter family: dflash (recommended: eagle3)"
