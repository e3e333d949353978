"""The figure check: every number a Markdown file shows is either a figure, named by its exact key in a
benchmark record, or marked as something else; and no figure quotes a stale record without saying so.

    python scripts/check_figures.py                 # every Markdown file that shows figures (FILES)
    python scripts/check_figures.py FILE...         # only these files
    python scripts/check_figures.py --stale         # the records, and which are stale and why

A number is marked by an HTML comment right after it (a reader of the rendered page sees only the number):

    1.48×<!--h200-pipeline.json#stages.deploy.figures.speedup_c1-->   a figure: a record and a JSON path
    0.55×<!--#serve.speedup.c8-->            the same record as the block's last figure (or the row's record)
    `--num-steps 3`, 3 epochs<!--setting-->  a setting or a count the text sets, not a measurement
    2.13×<!--external-->                     a figure from outside aerie (a datasheet, a paper, a price list)
    18.7 min<!--printed-->                   a number of a printed output on the same page (scripts/doc_outputs.py
                                             regenerates and checks those blocks)
    2.8 h<!--= 49.2 * 87.8 / 25.7 / 60-->    worked out from figures shown nearby: the arithmetic is checked

Numbers in code spans, fenced blocks, link targets and ordered-list markers are not figures. A comment
binds the number right before it and any number joined to it without a space (`6/8`). The figure must be
the value at that path, shown rounded (`1.48x` is 1.4779, `287K` is 286,751, `26.3 min` is 1,577 s, `-30%`
is -0.297); a path to a text value matches a number written in the text. A `#path` resolves against the
record of the block's previous figure, or, in a table with a `record` column, the one record that cell
names (its dates and commits are checked against the record and its git history).

Staleness is computed: every quoted record names `code_paths` (the code it measures) and may name `commit`
(the commit that wrote it; without it, the last commit that changed the record's file, which is the same
once a fresh record is committed); a record is stale when git shows commits since that one that changed
those paths, or when it says `stale` itself. A paragraph or table row quoting a stale record must say "stale" (or the heading of its section must).

Prints `file:line: what is wrong` for each problem; exits 1 if any, 0 otherwise.
"""

from __future__ import annotations

import ast
import json
import operator
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
# Every Markdown page that shows figures. Left out: the Markdown under benchmarks/results/ (reports a run
# wrote, records themselves) and aerie/known_targets/*/SOURCES.md (a shipped config's provenance: its
# numbers are that config.json's fields, which tests load).
FILES = ["README.md", "benchmarks/README.md", "benchmarks/gpu/README.md", "docs/*.md"]

CODE = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
COMMENT = re.compile(r"<!--(.*?)-->", re.S)
RECORD = re.compile(r"[\w.\-/]*?([\w\-]+\.json)")
DATE = re.compile(r"\b(\d{4}-\d{2}-\d{2})\b")
COMMIT = re.compile(r"\b([0-9a-f]{7,12})\b")
LIST_MARKER = re.compile(r"^(\s*)\d+\.(?=\s)", re.M)
MARK = re.compile(r"^\s*(?:(?P<name>[\w\-]+\.json))?#(?P<path>.+?)\s*$")
NOT_FIGURES = ("setting", "external", "printed")
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
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
    """A number as a page shows it: the values it may stand for in a record (scaled by its unit, or as
    written where the record keeps that unit: MiB/s, a percentage), each with half its last digit."""

    text: str
    candidates: tuple[tuple[float, float], ...]
    start: int = 0
    end: int = 0


def shown(m: re.Match[str]) -> Shown:
    digits = float(m["int"].replace(",", "") + (m["dec"] or ""))
    sign = -1.0 if m["sign"] in ("-", "−") else 1.0
    unit = m["glued"] or m["unit"] or ""
    scale = SCALE.get(unit, 1.0)
    half = 0.5 * 10.0 ** -(len(m["dec"]) - 1 if m["dec"] else 0)
    candidates = {(sign * digits * scale, half * scale), (sign * digits, half)}
    return Shown(m.group(0).strip(), tuple(sorted(candidates)), m.start(), m.end())


def blank(text: str, pattern: re.Pattern[str], keep: int = 0) -> str:
    """`text` with each match of `pattern` overwritten by spaces (its first `keep` characters kept), so
    positions still line up with the text."""
    return pattern.sub(lambda m: m.group(0)[:keep] + " " * (len(m.group(0)) - keep), text)


def plain(text: str) -> str:
    """What a reader sees as prose, position for position: code spans, link targets, comments and list
    markers blanked."""
    text = blank(text, COMMENT)
    text = blank(text, CODE)
    text = blank(text, LINK_TARGET, keep=1)
    return LIST_MARKER.sub(
        lambda m: m.group(0).replace(m.group(0).strip(), " " * len(m.group(0).strip())), text
    )


def numbers(text: str) -> Iterator[Shown]:
    """The numbers of a piece of Markdown outside code spans, link targets, comments and list markers."""
    for m in NUMBER.finditer(plain(text)):
        yield shown(m)


def leaves(value: Any) -> Iterator[float]:
    """Every number of a value, numbers written inside its text included."""
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
    """The value at a dotted path (a list's items by index, a key with dots in it as written:
    `figures.llama-3.1-8b.c1`); KeyError where there is none."""
    node, parts = record, path.split(".")
    while parts:
        if isinstance(node, list) and parts[0].isdigit() and int(parts[0]) < len(node):
            node, parts = node[int(parts[0])], parts[1:]
            continue
        if not isinstance(node, dict):
            raise KeyError(path)
        taken = next((n for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in node), 0)
        if not taken:
            raise KeyError(path)
        node, parts = node[".".join(parts[:taken])], parts[taken:]
    return node


@cache
def load(results: Path, name: str) -> dict[str, Any]:
    data = json.loads((results / name).read_text())
    return data if isinstance(data, dict) else {"items": data}


def git(root: Path, *args: str) -> list[str] | None:
    """git's output lines, or None where git cannot say (no repository, a shallow copy, an unknown commit)."""
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.split("\n")[:-1] if out else []


@cache
def commits_of(root: Path, rel: str) -> frozenset[str] | None:
    """The commits that changed a file, or None where git cannot say."""
    out = git(root, "log", "--follow", "--format=%H", "--", rel)
    return frozenset(out) if out else None


@cache
def stale_reason(root: Path, results: Path, name: str) -> str | None:
    """Why a record is stale (its own `stale` note, or the commits since it that changed the code it
    measures), or None where it is current or git cannot say."""
    record = load(results, name)
    if "stale" in record:
        return str(record["stale"])
    paths = record.get("code_paths")
    commit = record.get("commit") or written_by(root, str((results / name).relative_to(root)))
    if not commit or not paths:
        return None
    changed = git(root, "log", "--format=%h", f"{commit}..HEAD", "--", *paths)
    if not changed:
        return None
    return f"{len(changed)} commit(s) since {commit[:10]} changed {', '.join(paths)} (latest {changed[0]})"


@cache
def written_by(root: Path, rel: str) -> str | None:
    """The commit that last wrote a file, where git can say."""
    out = git(root, "log", "-1", "--format=%H", "--", rel)
    return out[0] if out else None


def unrecorded(results: Path, name: str) -> str | None:
    """What a quoted record lacks for its staleness to be computed: the code it measures."""
    return None if load(results, name).get("code_paths") else f"{name} names no code_paths"


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


@dataclass
class Block:
    """A paragraph, a list item or a table row: the unit whose figures share a record and a "stale"."""

    line: int  # of its first line
    text: str
    record_cell: str | None = None  # a table row's `record` cell, left out of `text`
    heading: str = ""  # of the section it is in: a "stale" there covers the section


def blocks(text: str) -> Iterator[Block]:
    """The blocks of a Markdown page outside fenced code."""
    lines, fenced, i = text.splitlines(), False, 0
    record_col: int | None = None
    current: list[str] = []
    start, heading = 0, ""

    def flush() -> Iterator[Block]:
        if current:
            yield Block(start + 1, "\n".join(current), heading=heading)
        current.clear()

    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            yield from flush()
            fenced = not fenced
        elif fenced or (line.startswith("    ") and not current and (i == 0 or not lines[i - 1].strip())):
            # fenced code, or an indented code block (a line of four spaces after a blank one): printed text
            while i + 1 < len(lines) and not fenced and lines[i + 1].startswith("    "):
                i += 1
        elif line.lstrip().startswith("|"):
            yield from flush()
            if i + 1 < len(lines) and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1]):
                header = [h.strip().lower() for h in split_row(line)]
                record_col = header.index("record") if "record" in header else None
                i += 2
                continue
            cells = split_row(line)
            cell = cells.pop(record_col) if record_col is not None and record_col < len(cells) else None
            yield Block(i + 1, " | ".join(cells), cell, heading)
        elif not line.strip() or line.lstrip().startswith("#") or re.match(r"^\s*([-*]|\d+\.)\s", line):
            yield from flush()
            if line.lstrip().startswith("#"):
                heading = line
            if line.strip():
                current.append(line)
                start = i
        else:
            if not current:
                start = i
            current.append(line)
        i += 1
    yield from flush()


@dataclass
class Context:
    root: Path
    results: Path
    outputs: tuple[float, ...]  # the numbers of the page's printed outputs


def check_record_cell(cell: str, ctx: Context) -> Iterator[str]:
    """A table's `record` cell: its records exist, its keys are in them, its dates and commits theirs."""
    names = sorted({m.group(1) for m in RECORD.finditer(cell)})
    if not names:
        yield "the record cell names no record (`name.json`)"
        return
    missing = [n for n in names if not (ctx.results / n).is_file()]
    if missing:
        yield f"no such record in {ctx.results.relative_to(ctx.root)}: {', '.join(missing)}"
        return
    records = {n: load(ctx.results, n) for n in names}
    keys = [k.strip("`") for k in CODE.findall(cell)]
    for key in keys:
        if RECORD.fullmatch(key) or COMMIT.fullmatch(key):
            continue
        if not any(_has(r, key) for r in records.values()):
            yield f"no key `{key}` in {', '.join(names)}"
    for day in DATE.findall(cell):
        if not any(str(r.get("date", ""))[:10] == day for r in records.values()):
            yield f"{day} is not the date of {', '.join(names)}"
    for commit in COMMIT.findall(plain(cell)):
        changed = [commits_of(ctx.root, str((ctx.results / n).relative_to(ctx.root))) for n in names]
        if any(c is None for c in changed):
            continue  # no history to check against
        if not any(h.startswith(commit) for c in changed for h in c or ()):
            yield f"commit {commit} did not change {', '.join(names)}"


def check_block(block: Block, ctx: Context) -> Iterator[tuple[int, str]]:
    """(where in the block's text, what is wrong) for its numbers."""
    default = None
    if block.record_cell is not None:
        yield from ((0, p) for p in check_record_cell(block.record_cell, ctx))
        names = {m.group(1) for m in RECORD.finditer(block.record_cell)}
        default = names.pop() if len(names) == 1 else None
    text = block.text
    seen = plain(text)
    found = [shown(m) for m in NUMBER.finditer(seen)]
    bound: set[int] = set()
    quoted: set[str] = set()
    in_code = [m.span() for m in CODE.finditer(text)]
    for mark in COMMENT.finditer(text):
        if any(a <= mark.start() < b for a, b in in_code):
            continue  # a comment shown as code, as in a page explaining the marks
        body = mark.group(1).strip()
        target = MARK.match(body)
        if body.startswith("="):
            chain = binds(found, seen, mark.start())
            bound.update(id(s) for s in chain)
            yield from ((mark.start(), p) for p in check_sum(chain, body[1:]))
            continue
        if body not in NOT_FIGURES and not target:
            continue  # a comment that marks nothing
        chain = binds(found, seen, mark.start())
        if not chain:
            yield mark.start(), f"<!--{body}--> follows no number"
            continue
        bound.update(id(s) for s in chain)
        if body == "printed":
            for s in chain:
                if not any(_matches(s, v) for v in ctx.outputs):
                    yield s.start, f"{s.text} is no number of this page's printed outputs"
        if not target:
            continue
        name = target["name"] or default
        if name is None:
            yield mark.start(), f"<!--{body}--> names no record, and no figure before it in its block does"
            continue
        default = name
        yield from ((mark.start(), p) for p in check_figure(chain, name, target["path"], ctx))
        quoted.add(name)
    for s in found:
        if id(s) not in bound:
            yield (
                s.start,
                f"{s.text}: a number with no record (mark it <!--name.json#path-->, or <!--setting-->)",
            )
    visible = " ".join((seen, block.record_cell or "", block.heading)).lower()
    for name in sorted(quoted):
        if not (ctx.results / name).is_file():
            continue
        lacking = unrecorded(ctx.results, name)
        if lacking:
            yield 0, lacking
        reason = stale_reason(ctx.root, ctx.results, name)
        if reason and "stale" not in visible:
            yield 0, f"{name} is stale ({reason}) and the text quoting it does not say so"


def binds(found: list[Shown], seen: str, at: int) -> list[Shown]:
    """The numbers a comment at `at` marks: the last one before it with no space between, and the ones
    joined to that one without a space (`6/8`)."""
    before = [s for s in found if s.end <= at]
    if not before or re.search(r"\s", seen[before[-1].end : at]):
        return []
    chain = [before[-1]]
    for s in reversed(before[:-1]):
        if re.search(r"\s", seen[s.end : chain[-1].start]):
            break
        chain.append(s)
    return chain


def check_sum(chain: list[Shown], expression: str) -> Iterator[str]:
    """A figure worked out from others: `expression` (numbers and + - * / parentheses) gives it."""
    if not chain:
        yield f"<!--={expression}--> follows no number"
        return
    try:
        value = arithmetic(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        yield f"<!--={expression}-->: not arithmetic on numbers ({exc})"
        return
    for s in chain:
        if not _matches(s, value):
            yield f"{s.text} is not {expression.strip()} ({value:.4g})"


def arithmetic(node: ast.expr) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -arithmetic(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](arithmetic(node.left), arithmetic(node.right))
    raise ValueError(ast.dump(node))


def check_figure(chain: list[Shown], name: str, path: str, ctx: Context) -> Iterator[str]:
    if not (ctx.results / name).is_file():
        yield f"no such record in {ctx.results.relative_to(ctx.root)}: {name}"
        return
    try:
        value = lookup(load(ctx.results, name), path)
    except KeyError:
        yield f"no key `{path}` in {name}"
        return
    if isinstance(value, dict | list):
        yield f"`{path}` of {name} is not one value (name the key of the figure itself)"
        return
    have = list(leaves(value))
    for s in chain:
        if not any(_matches(s, v) for v in have):
            yield f"{s.text} is not `{path}` of {name} ({value})"


def _has(record: dict[str, Any], key: str) -> bool:
    try:
        lookup(record, key)
    except KeyError:
        return False
    return True


def _matches(shown: Shown, value: float) -> bool:
    return any(abs(value - v) <= half * (1 + 1e-9) + 1e-12 for v, half in shown.candidates)


def output_numbers(text: str) -> tuple[float, ...]:
    """The numbers of the page's printed outputs: fenced blocks scripts/doc_outputs.py writes."""
    out: list[float] = []
    for block in re.finditer(r"<!-- output: .*?-->\s*```[^\n]*\n(.*?)```", text, re.S):
        out += [
            float(m.group(0).replace(",", "")) for m in re.finditer(r"\d[\d,]*(?:\.\d+)?", block.group(1))
        ]
    return tuple(out)


def check_file(path: Path, root: Path = ROOT, results: Path = RESULTS) -> Iterator[tuple[int, str]]:
    """(line number, problem) for each block of `path` whose numbers do not resolve."""
    text = path.read_text()
    ctx = Context(root, results, output_numbers(text))
    for block in blocks(text):
        for at, problem in check_block(block, ctx):
            yield block.line + block.text.count("\n", 0, at), problem


def expand(names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        out += sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(name)) if "*" in name else [name]
    return out


def report_stale() -> int:
    for record in sorted(RESULTS.glob("*.json")):
        reason = stale_reason(ROOT, RESULTS, record.name)
        lacking = unrecorded(RESULTS, record.name)
        print(f"{record.name}: {'stale: ' + reason if reason else lacking or 'current'}")
    return 0


def main(argv: list[str]) -> int:
    if argv == ["--stale"]:
        return report_stale()
    problems = 0
    for name in expand(argv or FILES):
        for number, problem in check_file(ROOT / name):
            print(f"{name}:{number}: {problem}")
            problems += 1
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
