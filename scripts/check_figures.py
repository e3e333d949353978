"""The figure check: every number in a table of the READMEs is a figure some benchmark record holds.

    python scripts/check_figures.py                 # README.md and benchmarks/README.md
    python scripts/check_figures.py FILE...         # only these files

A table that shows figures has a `record` column. Its cell in each row names the record(s) the row's
figures come from (`name.json`, looked up in benchmarks/results/), the keys in them (other `code` spans:
dotted paths such as `serve.speedup.c1`, a number for a list's index), and may name each record's date
(YYYY-MM-DD, which must be the record's) and the commit that wrote it (7 to 12 hex digits; with git at
hand it must be a commit that changed one of the named records). Every other number in the row, outside
`code` spans, must be a value under one of the named keys (numbers inside a text value count), shown
rounded: `1.48x` is 1.4779, `287K` is 286,751, `26.3 min` is 1,577 seconds, `-30%` is -0.297. A row of
a record marked `stale` says "stale". A table without a `record` column must show no number outside
`code` spans: settings belong in code spans, figures beside their record.

Prints `file:line: what is wrong` for each problem; exits 1 if any, 0 otherwise.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FILES = ["README.md", "benchmarks/README.md"]

CODE = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
RECORD = re.compile(r"[\w.\-/]*?([\w\-]+\.json)")
DATE = re.compile(r"\b(\d{4}-\d{2}-\d{2})\b")
COMMIT = re.compile(r"\b([0-9a-f]{7,12})\b")
# A number not glued to a word before it (H200, k7, SmolLM2-135M are names), its decimals, and its unit.
NUMBER = re.compile(
    r"(?<![\w.])(?<!\w-)(?P<sign>[-−+]?)(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?P<dec>\.\d+)?"
    r"(?:(?P<glued>[KMG%×x])|\s?(?P<unit>ms|min|GiB|MiB|GB|MB|KB|h|s)\b)?(?![A-Za-z])(?![\w.]*\d)"
)
SCALE = {"K": 1e3, "M": 1e6, "G": 1e9, "%": 1e-2, "ms": 1e-3, "min": 60.0, "h": 3600.0}
SCALE |= {"GB": 1e9, "MB": 1e6, "KB": 1e3, "GiB": 2.0**30, "MiB": 2.0**20}
TEXT_NUMBER = re.compile(r"[-−]?\d+(?:,\d{3})*(?:\.\d+)?")


@dataclass(frozen=True)
class Shown:
    """A number as a table shows it: the values it may stand for in a record (scaled by its unit, or as
    written where the record keeps that unit: MiB/s, a percentage), each with half its last digit."""

    text: str
    candidates: tuple[tuple[float, float], ...]


def numbers(cell: str) -> Iterator[Shown]:
    """The numbers of a table cell outside code spans and link targets."""
    plain = LINK_TARGET.sub("]", CODE.sub(" ", cell))
    for m in NUMBER.finditer(plain):
        digits = float(m["int"].replace(",", "") + (m["dec"] or ""))
        sign = -1.0 if m["sign"] in ("-", "−") else 1.0
        unit = m["glued"] or m["unit"] or ""
        scale = SCALE.get(unit, 1.0)
        half = 0.5 * 10.0 ** -(len(m["dec"]) - 1 if m["dec"] else 0)
        candidates = {(sign * digits * scale, half * scale), (sign * digits, half)}
        yield Shown(m.group(0).strip(), tuple(sorted(candidates)))


def leaves(value: Any) -> Iterator[float]:
    """Every number under a record's key, numbers written inside its text values included."""
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield float(value)
    elif isinstance(value, str):
        for m in TEXT_NUMBER.finditer(value):
            yield float(m.group(0).replace(",", "").replace("−", "-"))
    elif isinstance(value, dict):
        for item in value.values():
            yield from leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from leaves(item)


def lookup(record: Any, path: str) -> Any:
    """The value at a dotted path (a list's items by index); KeyError where there is none."""
    node = record
    for part in path.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise KeyError(path)
    return node


@cache
def load(results: Path, name: str) -> dict[str, Any]:
    data = json.loads((results / name).read_text())
    return data if isinstance(data, dict) else {"items": data}


@cache
def commits_of(root: Path, rel: str) -> frozenset[str] | None:
    """The commits that changed a file, or None where git cannot say (no repository, a shallow copy)."""
    try:
        out = subprocess.run(
            ["git", "log", "--follow", "--format=%H", "--", rel],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return frozenset(out) or None


def split_row(line: str) -> list[str]:
    """A markdown table row's cells ('|' inside code spans does not split)."""
    cells, current, in_code = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append(current.strip())
            current = ""
        else:
            current += char
    cells.append(current.strip())
    return cells


def tables(text: str) -> Iterator[tuple[list[str], list[tuple[int, list[str]]]]]:
    """(header cells, [(line number, cells)]) of each markdown table outside code blocks."""
    lines, fenced, i = text.splitlines(), False, 0
    while i < len(lines):
        if lines[i].lstrip().startswith("```"):
            fenced = not fenced
        is_table = lines[i].lstrip().startswith("|") and i + 1 < len(lines)
        if not fenced and is_table and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1]):
            header, rows, i = split_row(lines[i]), [], i + 2
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append((i + 1, split_row(lines[i])))
                i += 1
            yield header, rows
            continue
        i += 1


def check_row(cells: list[str], col: int, root: Path, results: Path) -> Iterator[str]:
    """What is wrong with one row of a table whose column `col` names its records."""
    source = cells[col] if col < len(cells) else ""
    names = sorted({m.group(1) for m in RECORD.finditer(source)})
    if not names:
        yield "the record cell names no record (`name.json`)"
        return
    missing = [n for n in names if not (results / n).is_file()]
    if missing:
        yield f"no such record in {results.relative_to(root)}: {', '.join(missing)}"
        return
    records = {n: load(results, n) for n in names}
    keys = [k.strip("`") for k in CODE.findall(source)]
    keys = [k for k in keys if not RECORD.fullmatch(k) and not COMMIT.fullmatch(k)]
    values: list[Any] = []
    for key in keys:
        found = [lookup(r, key) for r in records.values() if _has(r, key)]
        if not found:
            yield f"no key `{key}` in {', '.join(names)}"
        values += found
    for day in DATE.findall(source):
        if not any(str(r.get("date", ""))[:10] == day for r in records.values()):
            yield f"{day} is not the date of {', '.join(names)}"
    for commit in COMMIT.findall(source):
        changed = [commits_of(root, str((results / n).relative_to(root))) for n in names]
        if any(c is None for c in changed):
            continue  # no history to check against
        if not any(h.startswith(commit) for c in changed for h in c or ()):
            yield f"commit {commit} did not change {', '.join(names)}"
    row_text = " ".join(cells)
    for name, record in records.items():
        if "stale" in record and "stale" not in row_text.lower():
            yield f"{name} is marked stale ({record['stale']}) and the row does not say so"
    have = [v for value in values for v in leaves(value)]
    for i, cell in enumerate(cells):
        if i == col:
            continue
        for shown in numbers(cell):
            if not any(_matches(shown, v) for v in have):
                where = ", ".join(f"`{k}`" for k in keys) or "(no key named)"
                yield f"{shown.text} is not a value under {where} of {', '.join(names)}"


def _has(record: dict[str, Any], key: str) -> bool:
    try:
        lookup(record, key)
    except KeyError:
        return False
    return True


def _matches(shown: Shown, value: float) -> bool:
    return any(abs(value - v) <= half * (1 + 1e-9) + 1e-12 for v, half in shown.candidates)


def check_file(path: Path, root: Path = ROOT, results: Path = RESULTS) -> Iterator[tuple[int, str]]:
    """(line number, problem) for each table row of `path` whose figures do not resolve."""
    for header, rows in tables(path.read_text()):
        cols = [i for i, h in enumerate(header) if h.strip().lower() == "record"]
        for number, cells in rows:
            if cols:
                for problem in check_row(cells, cols[0], root, results):
                    yield number, problem
                continue
            shown = [s.text for cell in cells for s in numbers(cell)]
            if shown:
                yield number, f"{', '.join(shown)}: a number in a table without a `record` column"


def main(argv: list[str]) -> int:
    names = argv or FILES
    problems = 0
    for name in names:
        for number, problem in check_file(ROOT / name):
            print(f"{name}:{number}: {problem}")
            problems += 1
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
