"""The run's headline figures, read at a glance: the drafter's acceptance length against prompt lookup's
(per prompt set, at the longest chain evaluated), the served speed-up per concurrency level, and
whether the drafter was promoted. The pipeline flow shows them as its summary table and ends its log
with them."""

from __future__ import annotations

import re
from typing import Any

from aerie.manifest import StageResult

PROMPT_LOOKUP = "prompt_lookup"
# accept_<dataset>_<proposer>_k<steps> (greedy; sampled and reasoning/answer figures carry a suffix).
_ACCEPT = re.compile(r"^accept_(?P<dataset>.+?)_(?P<proposer>prompt_lookup|[a-z0-9]+)_k(?P<k>\d+)$")


def headline_rows(results: list[StageResult]) -> list[dict[str, Any]]:
    """One row per headline figure: what it is, its value, and what it is measured against."""
    by_stage = {r.stage: r for r in results}
    rows: list[dict[str, Any]] = []
    if (evaluation := by_stage.get("evaluate")) is not None:
        rows += _acceptance_rows(evaluation.figures)
    if (deployment := by_stage.get("deploy")) is not None:
        rows += _served_rows(deployment.figures)
    elif rows:
        rows.append({"figure": "served", "value": "not measured", "against": "no deploy stage in this run"})
    return rows


def headline_text(results: list[StageResult]) -> str:
    """The headline rows as one line (the run log's last)."""
    return "; ".join(f"{r['figure']} {r['value']} ({r['against']})" for r in headline_rows(results))


def _acceptance_rows(figures: dict[str, Any]) -> list[dict[str, Any]]:
    found: dict[tuple[str, int], dict[str, float]] = {}
    for name, value in figures.items():
        match = _ACCEPT.match(name)
        if match and isinstance(value, int | float):
            key = (match["dataset"], int(match["k"]))
            found.setdefault(key, {})[match["proposer"]] = float(value)
    longest = {dataset: max(k for d, k in found if d == dataset) for dataset, _ in found}
    rows = []
    for (dataset, k), by_proposer in sorted(found.items()):
        drafters = {p: v for p, v in by_proposer.items() if p != PROMPT_LOOKUP}
        if k != longest[dataset] or not drafters:
            continue
        for proposer, value in drafters.items():
            lookup = by_proposer.get(PROMPT_LOOKUP)
            rows.append(
                {
                    "figure": f"accept length, {dataset}, {proposer}, {k} draft steps",
                    "value": round(value, 3),
                    "against": f"prompt lookup {lookup:.3f}" if lookup is not None else "no prompt lookup",
                }
            )
    return rows


def _served_rows(figures: dict[str, Any]) -> list[dict[str, Any]]:
    if figures.get("deployed") is False:
        return [{"figure": "served", "value": "not deployed", "against": "deploy.enabled is false"}]
    rows = []
    for name, spec in sorted(figures.items()):
        if not name.startswith("spec_tok_s_c"):
            continue
        level = name.removeprefix("spec_tok_s_c")
        base = figures.get(f"base_tok_s_c{level}")
        if base:
            rows.append(
                {
                    "figure": f"served speed-up at concurrency {level}",
                    "value": f"{spec / base:.2f}x",
                    "against": f"{spec:.1f} against {base:.1f} tokens/s without the drafter",
                }
            )
    promoted = figures.get("promoted")
    rows.append(
        {
            "figure": "promoted",
            "value": "yes" if promoted else "no",
            "against": f"speed-up {figures.get('speedup')}x at the deciding level",
        }
    )
    return rows
