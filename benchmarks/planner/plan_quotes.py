"""The plan-accuracy record, quoted where a reader looks: the README's headline row, benchmarks/README.md's
table and docs/plan.md's validation section. `plan_accuracy.py` rewrites them each time it writes the
record, so no quoted figure is older than the record (scripts/check_figures.py checks the README tables).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

BEGIN = "<!-- plan-accuracy: written by benchmarks/planner/plan_accuracy.py from {name} -->"
END = "<!-- end of plan-accuracy -->"
README_ROW = "| `aerie plan`'s stage estimates, on runs it was never fitted to |"
WITHIN = 0.25  # the summary's `within_25_percent`


def between_markers(text: str, name: str, body: str, where: str) -> str:
    """`text` with what lies between the markers replaced by `body`."""
    begin = BEGIN.format(name=name)
    if begin not in text or END not in text:
        raise SystemExit(f"{where}: no `{begin}` ... `{END}` section to write the plan's rows into")
    head, rest = text.split(begin, 1)
    return f"{head}{begin}\n{body.strip()}\n{END}{rest.split(END, 1)[1]}"


def runs(validation: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The validation rows grouped by run (a run's rows share its preset and start), in record order."""
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in validation:
        out.setdefault((r["preset"], r["run"]["start"]), []).append(r)
    return list(out.values())


def key(path: str, name: str = "") -> str:
    """The comment after a figure that names its key (scripts/check_figures.py checks it)."""
    return f"<!--{name}#{path}-->"


def shown(r: dict[str, Any], field: str, at: str) -> str:
    value = r[field]
    if value is None:
        return ""
    said = f"{value / 1e6:.1f} MB" if r["unit"] == "bytes" else f"{value:.1f} s"
    return said + key(f"{at}.{field}")


def error(value: float, at: str = "") -> str:
    return f"{value:+.1%}" + (key(at) if at else "")


def load_words(r: dict[str, Any], at: str) -> str:
    load = r.get("load_while_running") or {}
    if not load.get("samples"):
        return "load not sampled"
    at += ".load_while_running"
    return (
        f"load average {load['load_1m_mean']}{key(at + '.load_1m_mean')} (max {load['load_1m_max']}"
        f"{key(at + '.load_1m_max')}) on `{load['cores']}` cores"
    )


def run_heading(first: dict[str, Any], at: str, name: str) -> str:
    preset, *overrides = first["preset"].split()
    run = first["run"]
    said = (
        f"**`{preset}`** with `{' '.join(overrides)}`, planned for `{first['hardware']}`, run from "
        f"`{run['start']}` to `{run['end']}` at commit `{run['model_commit'][:10]}`; "
        f"{load_words(first, at).replace('<!--#', f'<!--{name}#', 1)} while it ran"
    )
    machine = first.get("machine_at_plan")
    if machine:
        said += (
            f"; the plan's probe read this machine at {machine['ratio']}x{key(at + '.machine_at_plan.ratio')} "
            f"the calibration machine's multiply rate, other work using {machine['others_share']:.0%}"
            f"{key(at + '.machine_at_plan.others_share')} of the cores"
        )
    return said + ":"


def index(rows: list[dict[str, Any]], row: dict[str, Any]) -> int:
    return next(i for i, r in enumerate(rows) if r is row)


def docs_section(record: dict[str, Any], left_out: list[dict[str, Any]], name: str) -> str:
    validation = record["validation"]
    if not validation:
        return (
            "### Validation rows\n\n"
            "None is recorded yet. Until one is, every figure on this page is a calibration figure: how well\n"
            "the model fits the runs it was built on, not how well it predicts."
        )
    s = record["validation_summary"]
    worst = s["worst"]
    lines = [
        "### Validation rows",
        "",
        f"{s['within_25_percent']}{key('validation_summary.within_25_percent', name)} of {s['rows']}"
        f"{key('validation_summary.rows')} stage estimates came within `{WITHIN:.0%}` of the actual; the worst, "
        f"{worst['stage']}, by {error(worst['error'], 'validation_summary.worst.error')}. Each run against the "
        "plan printed before it started:",
    ]
    for group in runs(validation):
        lines += ["", run_heading(group[0], f"validation.{index(validation, group[0])}", name), ""]
        lines += [
            "| stage | estimate | actual | error | re-planned after the merge |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in group:
            at = f"validation.{index(validation, r)}"
            after = shown(r, "estimate_after_merge", at) if r.get("estimate_after_merge") is not None else ""
            lines.append(
                f"| {r['stage']} | {shown(r, 'estimate', at)} | {shown(r, 'actual', at)} | "
                f"{error(r['error'], at + '.error')} | {after} |".replace("<!--#", f"<!--{name}#", 1)
            )
        skipped = [x["stage"] for x in left_out if x["preset"] == group[0]["preset"]]
        if skipped:
            lines += ["", f"Left out: {', '.join(skipped)}, whose settings were a calibration run's."]
    return "\n".join(lines)


def results_table(record: dict[str, Any], name: str) -> str:
    """benchmarks/README.md's table: every validation row, then the calibration rows' summary."""
    day = record["date"][:10]
    lines = ["| run | stage | estimate | actual | error | record |", "|---|---|---:|---:|---:|---|"]
    first = {id(group[0]) for group in runs(record["validation"])}
    for i, r in enumerate(record["validation"]):
        preset, *overrides = r["preset"].split()
        at = f"validation.{i}"
        run = (
            f"validation: `{preset}` `{' '.join(overrides)}` on `{r['hardware']}`, commit "
            f"`{r['run']['model_commit'][:10]}`, {load_words(r, at)}"
            if id(r) in first
            else "the same run"
        )
        lines.append(
            f"| {run} | {r['stage']} | {shown(r, 'estimate', at)} | {shown(r, 'actual', at)} | "
            f"{error(r['error'], at + '.error')} | `{name}` `validation.{i}` {day} |"
        )
    c = record["calibration_summary"]
    worst = c["worst"]
    lines.append(
        f"| calibration: every row (fitted, or in view while the model was revised) | all | | | "
        f"{c['within_25_percent']}{key('calibration_summary.within_25_percent')} of {c['rows']}"
        f"{key('calibration_summary.rows')} within `25%`; worst {error(worst['error'], 'calibration_summary.worst.error')} "
        f"(`{worst['preset']}` {worst['stage']}) | `{name}` `calibration_summary` {day} |"
    )
    if not record["validation"]:
        lines += ["", "No validation run is recorded yet (`benchmarks/gpu/job.sh plan-validate` makes one)."]
    return "\n".join(lines)


def readme_row(record: dict[str, Any], name: str) -> str:
    link = f"[`{name}`](benchmarks/results/{name}) `validation_summary`"
    validation = record["validation"]
    if not validation:
        return f"{README_ROW} aerie's stages | a shared CPU machine | none recorded yet, only calibration rows | {link} |"
    s = record["validation_summary"]
    hardware = ", ".join(f"`{h}`" for h in dict.fromkeys(r["hardware"] for r in validation))
    presets = ", ".join(f"`{p}`" for p in dict.fromkeys(r["preset"].split()[0] for r in validation))
    worst = s["worst"]
    return (
        f"{README_ROW} aerie's stages | {hardware}; {presets} at sizes no calibration run used | "
        f"{s['within_25_percent']}{key('validation_summary.within_25_percent')} of {s['rows']}"
        f"{key('validation_summary.rows')} within `25%`, worst {error(worst['error'], 'validation_summary.worst.error')} "
        f"({worst['stage']}) | {link} |"
    )


def stale_words(root: Path, name: str) -> str:
    """ " (stale)" where the code the record measures changed since it was written (scripts/check_figures.py
    fails a quote of a stale record that does not say so), else nothing."""
    spec = importlib.util.spec_from_file_location("check_figures", root / "scripts" / "check_figures.py")
    if not spec or not spec.loader or not spec.origin or not Path(spec.origin).is_file():
        return ""
    check = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, check)
    spec.loader.exec_module(check)
    results = root / "benchmarks" / "results"
    return " (stale)" if (results / name).is_file() and check.stale_reason(root, results, name) else ""


def quote(record: dict[str, Any], name: str, root: Path) -> None:
    """Rewrite the three places that quote the record."""
    left_out = record.get("validation_left_out", [])
    stale = stale_words(root, name)
    docs = root / "docs" / "plan.md"
    section = docs_section(record, left_out, name).replace(
        "### Validation rows", "### Validation rows" + stale, 1
    )
    docs.write_text(between_markers(docs.read_text(), name, section, str(docs)))
    bench = root / "benchmarks" / "README.md"
    table = results_table(record, name).replace(f"{name}` `", f"{name}`{stale} `")
    bench.write_text(between_markers(bench.read_text(), name, table, str(bench)))
    readme = root / "README.md"
    lines = readme.read_text().splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if line.startswith(README_ROW)]
    if len(at) != 1:
        raise SystemExit(
            f"{readme}: no single headline row starting {README_ROW!r} to write the summary into"
        )
    lines[at[0]] = readme_row(record, name).removesuffix(" |") + f"{stale} |\n"
    readme.write_text("".join(lines))
