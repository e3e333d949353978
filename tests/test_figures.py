"""scripts/check_figures.py: every number of the docs is a figure at its exact key of a benchmark record, or
marked as something else.

The docs themselves are checked (with git for the commits they name and the staleness of each record); the
checker is shown to catch a wrong figure, a swapped one, a key naming a subtree, a missing key, a wrong
date, an unmarked stale quote (declared, and computed from a real repository's history) and a number
without a record, on planted pages beside a planted record."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
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


@pytest.mark.integration  # git log, for the commits the tables name and the staleness of each record
def test_every_figure_of_the_docs_is_in_a_record() -> None:
    """What `make lint` runs, on the pages it names: every page that shows figures (the check's FILES)."""
    makefile = (ROOT / "Makefile").read_text()
    pages = re.search(r"^FIGURE_PAGES \?= (.*)$", makefile, re.M).group(1).split()  # type: ignore[union-attr]
    assert pages == checker().FILES
    names = checker().expand(pages)
    problems = [f"{n}:{line}: {what}" for n in names for line, what in checker().check_file(ROOT / n)]
    assert problems == [], "\n".join(problems)


def test_the_readmes_show_their_headline_figures_beside_records() -> None:
    """The check has something to check: both READMEs hold figures marked with their record's key."""
    for name in ("README.md", "benchmarks/README.md"):
        assert "<!--#" in (ROOT / name).read_text(), f"{name} marks no figure with its key"


RECORD = {
    "date": "2026-01-02T03:04:05+00:00",
    "code_paths": ["code.py"],
    "commit": "0123456789abcdef0123456789abcdef01234567",
    "serve": {"speedup": {"c1": 1.4779, "c8": 1.2865}, "identical": "6/8"},
    "extract": {"tokens_per_s": 286750.6, "share": 0.297, "error": -0.297, "seconds": 1577.0},
}


def planted(tmp_path: Path, table: str, record: dict | None = None) -> list[tuple[int, str]]:
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    (results / "bench-cpu.json").write_text(json.dumps(record or RECORD))
    checker().load.cache_clear()
    checker().stale_reason.cache_clear()
    (tmp_path / "README.md").write_text(table)
    return list(checker().check_file(tmp_path / "README.md", root=tmp_path, results=results))


HEAD = "| what | figure | record |\n|---|---|---|\n"


@pytest.mark.integration  # git log, for the commit a record names
def test_figures_that_round_to_their_keys_pass(tmp_path: Path) -> None:
    table = HEAD + (
        "| served at `c1`, `c8` | 1.48x<!--#serve.speedup.c1--> / 1.29×<!--#serve.speedup.c8--> "
        "(6/8<!--#serve.identical--> identical) | `bench-cpu.json` `serve` 2026-01-02 |\n"
        "| extraction | 287K<!--#extract.tokens_per_s--> tokens/s, 26.3 min<!--#extract.seconds-->, "
        "−30%<!--#extract.error--> and 29.7%<!--#extract.share--> | `bench-cpu.json` `extract` |\n"
    )
    prose = "\nExtraction ran at 287K<!--bench-cpu.json#extract.tokens_per_s--> tokens/s on 8<!--setting--> workers.\n"
    assert planted(tmp_path, table + prose) == []


@pytest.mark.integration  # git log, for the commit a record names
def test_a_swapped_figure_fails(tmp_path: Path) -> None:
    """c1's figure quoted as c8's and c8's as c1's: each is a value of the record, and neither passes."""
    row = "| served | 1.29x<!--#serve.speedup.c1--> / 1.48x<!--#serve.speedup.c8--> | `bench-cpu.json` |\n"
    assert [p for _, p in planted(tmp_path, HEAD + row)] == [
        "1.29x is not `serve.speedup.c1` of bench-cpu.json (1.4779)",
        "1.48x is not `serve.speedup.c8` of bench-cpu.json (1.2865)",
    ]


@pytest.mark.integration  # git log, for the commit a record names
def test_a_key_naming_a_subtree_fails(tmp_path: Path) -> None:
    row = "| served | 1.48x<!--#serve.speedup--> | `bench-cpu.json` |\n"
    assert [p for _, p in planted(tmp_path, HEAD + row)] == [
        "`serve.speedup` of bench-cpu.json is not one value (name the key of the figure itself)"
    ]


def test_a_number_without_a_record_fails_in_a_table_and_in_prose(tmp_path: Path) -> None:
    text = "| preset | hardware |\n|---|---|\n| `kimi` | 8 GPUs, 595 GB |\n\nIt ran at 1.48x.\n"
    problems = [p for _, p in planted(tmp_path, text)]
    assert [p.split(":")[0] for p in problems] == ["8", "595 GB", "1.48x"]
    assert all("a number with no record" in p for p in problems)


@pytest.mark.integration  # git log, for the commit a record names
def test_a_missing_key_a_wrong_date_and_a_missing_record_fail(tmp_path: Path) -> None:
    table = HEAD + (
        "| a | 1.48x<!--#serve.speedup.c4--> | `bench-cpu.json` 2026-01-03 |\n"
        "| b | 2<!--#x--> | `other-cpu.json` |\n"
    )
    problems = [p for _, p in planted(tmp_path, table)]
    assert "no key `serve.speedup.c4` in bench-cpu.json" in problems
    assert "2026-01-03 is not the date of bench-cpu.json" in problems
    assert "no such record in results: other-cpu.json" in problems


def test_a_worked_out_figure_is_checked(tmp_path: Path) -> None:
    good = "Twice the rate is 574K<!--= 2 * 287-->.\n"
    assert planted(tmp_path, good) == []
    assert [p for _, p in planted(tmp_path, good.replace("574K", "600K"))] == ["600K is not 2 * 287 (574)"]


def test_a_record_marked_stale_must_be_said_stale(tmp_path: Path) -> None:
    record = {**RECORD, "stale": "since 2026-02-01: the stage was rewritten"}
    row = "| served | 1.48x<!--#serve.speedup.c1--> | `bench-cpu.json` |\n"
    assert [p for _, p in planted(tmp_path, HEAD + row, record)] == [
        "bench-cpu.json is stale (since 2026-02-01: the stage was rewritten) and the text quoting it does not say so"
    ]
    assert planted(tmp_path, HEAD + row.replace("served", "served (stale)"), record) == []


def git_repo(root: Path) -> None:
    """A repository in `root` with its files committed."""
    for args in (
        ["init", "-q"],
        ["add", "-A"],
        ["-c", "user.name=a", "-c", "user.email=a@b", "commit", "-qm", "x"],
    ):
        subprocess.run(["git", *args], cwd=root, check=True)


@pytest.mark.integration  # a git repository: staleness is computed from its history
def test_a_record_whose_code_changed_since_is_stale_and_an_unmarked_quote_fails(tmp_path: Path) -> None:
    (tmp_path / "code.py").write_text("SPEED = 1\n")
    text = "Served at 1.48x<!--bench-cpu.json#serve.speedup.c1-->.\n"
    planted(tmp_path, text)  # writes the page and the record
    git_repo(tmp_path)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout
    record = {**RECORD, "code_paths": ["code.py"], "commit": head.strip()}
    assert planted(tmp_path, text, record) == []  # current: nothing changed code.py since
    (tmp_path / "code.py").write_text("SPEED = 2\n")
    subprocess.run(
        ["git", "-c", "user.name=a", "-c", "user.email=a@b", "commit", "-qam", "faster"], cwd=tmp_path
    )
    checker().stale_reason.cache_clear()
    problems = [p for _, p in planted(tmp_path, text, record)]
    assert len(problems) == 1 and "bench-cpu.json is stale (1 commit(s) since" in problems[0], problems
    checker().stale_reason.cache_clear()
    assert planted(tmp_path, text.replace("Served", "Served (stale)"), record) == []


@pytest.mark.integration  # git log, for the commit a record names
def test_a_quoted_record_must_name_the_code_it_measures(tmp_path: Path) -> None:
    record = {k: v for k, v in RECORD.items() if k not in ("code_paths", "commit")}
    problems = [p for _, p in planted(tmp_path, "At 1.48x<!--bench-cpu.json#serve.speedup.c1-->.\n", record)]
    assert problems == ["bench-cpu.json names no code_paths"]


@pytest.mark.integration  # a git repository: the record's own last commit stands for the one it names
def test_a_record_naming_no_commit_is_dated_by_the_commit_that_wrote_it(tmp_path: Path) -> None:
    (tmp_path / "code.py").write_text("SPEED = 1\n")
    text = "Served at 1.48x<!--bench-cpu.json#serve.speedup.c1-->.\n"
    record = {k: v for k, v in RECORD.items() if k != "commit"}
    planted(tmp_path, text, record)
    git_repo(tmp_path)  # code and record in one commit: current
    assert planted(tmp_path, text, record) == []
    (tmp_path / "code.py").write_text("SPEED = 2\n")
    subprocess.run(
        ["git", "-c", "user.name=a", "-c", "user.email=a@b", "commit", "-qam", "faster"], cwd=tmp_path
    )
    checker().written_by.cache_clear()
    problems = [p for _, p in planted(tmp_path, text, record)]
    assert len(problems) == 1 and "is stale (1 commit(s) since" in problems[0], problems


def test_names_with_digits_and_list_markers_are_not_figures() -> None:
    shown = [s.text for s in checker().numbers("1. SmolLM2-135M on an H200, fp8, k7, Qwen3-8B: 3.15")]
    assert shown == ["3.15"]


def test_a_printed_plan_compares_without_what_the_machines_free_disk_decides() -> None:
    """scripts/doc_outputs.py: the same plan printed where the disk has room and where it has not compares
    equal (the free space and the refusal it brings are the machine's); a refusal of another kind does not."""
    spec = importlib.util.spec_from_file_location("doc_outputs", ROOT / "scripts" / "doc_outputs.py")
    assert spec and spec.loader
    doc_outputs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(doc_outputs)
    roomy = "disk (at its fullest)\n  /root/.cache/x: 50.5 GB, 62.1 GB free\n  s3://bucket: 1 GB\n"
    short = (
        "disk (at its fullest)\n  /root/.cache/x: 50.5 GB, 47.2 GB free  SHORT\n  s3://bucket: 1 GB\n"
        "\ncannot fit\n  - NotEnoughDiskError: not enough disk for this run: x\n"
        "aerie: error: not enough disk for this run: x\n"
    )
    assert doc_outputs.machine_free(roomy) == doc_outputs.machine_free(short)
    other = short.replace("aerie: error", "  - MemoryError: too big\naerie: error")
    assert doc_outputs.machine_free(roomy) != doc_outputs.machine_free(other)
