"""scripts/check_figures.py: every number in a table of the READMEs resolves to a key of a benchmark record.

The READMEs themselves are checked (with git for the commits they name); the checker is shown to catch a
wrong figure, a missing key, a wrong date, an unmarked stale record and a figure with no record, on
planted tables beside a planted record."""

from __future__ import annotations

import importlib.util
import json
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@cache
def checker() -> ModuleType:
    """The script, imported by path (scripts/ is not a package); registered first, as dataclasses need."""
    spec = importlib.util.spec_from_file_location("check_figures", ROOT / "scripts" / "check_figures.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.integration  # git log, for the commits the tables name
@pytest.mark.parametrize("name", ["README.md", "benchmarks/README.md"])
def test_every_table_figure_of_the_readmes_is_in_a_record(name: str) -> None:
    problems = list(checker().check_file(ROOT / name))
    assert problems == [], "\n".join(f"{name}:{line}: {what}" for line, what in problems)


def test_the_readmes_show_their_headline_figures_beside_records() -> None:
    """The check has something to check: both READMEs hold tables with a record column."""
    check = checker()
    for name in ("README.md", "benchmarks/README.md"):
        found = [h for h, rows in check.tables((ROOT / name).read_text()) if "record" in h and rows]
        assert found, f"{name} has no table with a record column"


RECORD = {
    "date": "2026-01-02T03:04:05+00:00",
    "serve": {"speedup": {"c1": 1.4779, "c8": 1.2865}, "identical": "6/8"},
    "extract": {"tokens_per_s": 286750.6, "share": 0.297, "error": -0.297, "seconds": 1577.0},
}


def planted(tmp_path: Path, table: str, record: dict | None = None) -> list[tuple[int, str]]:
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    (results / "bench-cpu.json").write_text(json.dumps(record or RECORD))
    (tmp_path / "README.md").write_text(table)
    return list(checker().check_file(tmp_path / "README.md", root=tmp_path, results=results))


HEAD = "| what | figure | record |\n|---|---|---|\n"


def test_figures_that_round_to_the_record_pass(tmp_path: Path) -> None:
    table = HEAD + (
        "| served at `c1`, `c8` | 1.48x / 1.29× (6/8 identical) | `bench-cpu.json` `serve` 2026-01-02 |\n"
        "| extraction | 287K tokens/s, 26.3 min, −30% and 29.7% | `bench-cpu.json` `extract` |\n"
    )
    assert planted(tmp_path, table) == []


def test_a_figure_no_key_holds_fails(tmp_path: Path) -> None:
    problems = planted(tmp_path, HEAD + "| served | 1.52x | `bench-cpu.json` `serve.speedup` |\n")
    assert problems == [(3, "1.52x is not a value under `serve.speedup` of bench-cpu.json")]


def test_a_figure_from_another_key_of_the_same_record_fails(tmp_path: Path) -> None:
    problems = planted(tmp_path, HEAD + "| served | 287K | `bench-cpu.json` `serve` |\n")
    assert [p for _, p in problems] == ["287K is not a value under `serve` of bench-cpu.json"]


def test_a_missing_key_a_wrong_date_and_a_missing_record_fail(tmp_path: Path) -> None:
    table = HEAD + (
        "| a | 1.48x | `bench-cpu.json` `serve.speedup.c4` 2026-01-03 |\n| b | 2 | `other-cpu.json` |\n"
    )
    problems = [p for _, p in planted(tmp_path, table)]
    assert "no key `serve.speedup.c4` in bench-cpu.json" in problems
    assert "2026-01-03 is not the date of bench-cpu.json" in problems
    assert "no such record in results: other-cpu.json" in problems


def test_a_stale_record_must_be_said_stale(tmp_path: Path) -> None:
    record = {**RECORD, "stale": "since 2026-02-01: the stage was rewritten"}
    row = "| served | 1.48x | `bench-cpu.json` `serve` |\n"
    assert [p for _, p in planted(tmp_path, HEAD + row, record)] == [
        "bench-cpu.json is marked stale (since 2026-02-01: the stage was rewritten) and the row does not say so"
    ]
    assert planted(tmp_path, HEAD + row.replace("served", "served (stale)"), record) == []


def test_a_number_in_a_table_without_a_record_column_fails_and_settings_in_code_pass(tmp_path: Path) -> None:
    table = "| preset | hardware |\n|---|---|\n| `smollm2-gpu` | one H200, `--num-steps 3` |\n"
    assert planted(tmp_path, table) == []
    problems = planted(tmp_path, table + "| `kimi` | 8 GPUs, 595 GB |\n")
    assert problems == [(4, "8, 595 GB: a number in a table without a `record` column")]


def test_names_with_digits_are_not_figures() -> None:
    shown = [s.text for s in checker().numbers("SmolLM2-135M on an H200, fp8, k7, Qwen3-8B: 3.15")]
    assert shown == ["3.15"]
