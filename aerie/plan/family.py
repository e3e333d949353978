"""The drafter family `aerie plan` recommends (EAGLE-3 or DFlash), from the measurements on record.

`data/families.json` holds the recommendation, why, and the figures it rests on, each naming the
benchmark record it was read from (tests/test_plan_family.py checks them against the records). The
plan prints it beside the family the config trains, so a run that trains the other one says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aerie.config import PipelineConfig

DATA = Path(__file__).parent / "data" / "families.json"


def evidence() -> dict[str, Any]:
    """The recommendation file as it is."""
    return json.loads(DATA.read_text())  # type: ignore[no-any-return]


def lines(cfg: PipelineConfig) -> list[str]:
    """The plan's "drafter family" section: the recommendation, why, and its figures."""
    data = evidence()
    figures = {e["key"]: e for e in data["evidence"]}
    chosen, recommended = cfg.train.drafter.family, data["recommended"]
    verdict = "as recommended" if chosen == recommended else f"recommended: {recommended}"
    source = sorted({e["source"] for e in data["evidence"]})
    out = ["", f"drafter family: {chosen} ({verdict})", f"  why: {data['why']}"]
    out.append(
        f"  measured ({', '.join('benchmarks/results/' + s for s in source)}; "
        f"{figures['conversations']['value']:,} conversations, {figures['train_tokens']['value']:,} tokens each):"
    )
    for family in ("eagle3", "dflash"):
        mt, held = figures[f"{family}_mtbench"]["value"], figures[f"{family}_heldout"]["value"]
        first = figures[f"{family}_first_position"]["value"]
        out.append(f"    {family}: MT-Bench {mt:.2f}, held-out {held:.2f}, first draft accepted {first:.0%}")
    return out
