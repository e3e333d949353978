"""Fold the device run's outputs into benchmarks/results/sglang-h200.json.

    python benchmarks/sglang_h200/record.py --extract DIR --serve DIR [--serve-short DIR] [--offline FILE]

DIR holds what `dev.sh extract` / `dev.sh serve` wrote to their output folder (extract.json, serve.json); --offline is the
report of `aerie evaluate --json` on the same drafter and prompts. The record's earlier `extract` block (its
roofline measured in that run) is kept; this run's extraction goes beside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RECORD = Path(__file__).resolve().parents[1] / "results" / "sglang-h200.json"
LEVELS = ("c1", "c8", "c32")


def _levels(mode: dict) -> dict:
    return {k: {f: v for f, v in mode[k].items() if f != "texts"} for k in LEVELS if k in mode}


def _serve(serve: dict) -> dict:
    base, spec = serve["modes"]["baseline"], serve["modes"]["eagle3"]
    cmp = serve["compare"]
    return {
        "speedup": {k: cmp[f"speedup_{k}"] for k in LEVELS},
        "accept_length": spec["c1"]["accept_length"],
        "accept_length_by_level": {k: cmp[f"accept_length_{k}"] for k in LEVELS},
        "identical_outputs": {k: cmp[f"identical_outputs_{k}"] for k in LEVELS},
        "mean_common_prefix_share": {k: cmp[f"mean_common_prefix_share_{k}"] for k in LEVELS},
        "baseline": {"startup_s": base["startup_s"], **_levels(base), "command": base["command"]},
        "eagle3": {"startup_s": spec["startup_s"], **_levels(spec), "command": spec["command"]},
    }


def _offline(report: dict) -> dict:
    rows = [r for r in report["results"] if r["proposer"] == "eagle3"]
    return {
        f"k{r['num_steps']}": {
            "spec_accept_length": r["spec_accept_length"],
            "accept_length": r["accept_length"],
            "sequences": r["sequences"],
            "conditional_acceptance": r["conditional_acceptance"],
        }
        for r in rows
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--extract", type=Path, required=True)
    ap.add_argument("--serve", type=Path, required=True)
    ap.add_argument("--serve-short", type=Path, help="a second eagle3-only serve run (shorter chain)")
    ap.add_argument("--offline", type=Path)
    ap.add_argument("--date", required=True)
    args = ap.parse_args()
    record = json.loads(RECORD.read_text())
    ext = json.loads((args.extract / "extract.json").read_text())
    serve = json.loads((args.serve / "serve.json").read_text())
    pipe = ext["pipeline"]["sglang"]
    record["date"] = args.date
    record["extract_with_serve"] = {
        "tokens_per_s": pipe["steady_tokens_per_s"],
        "wall_s_incl_startup_and_canary": pipe["wall_s_incl_startup_and_canary"],
        "canary_passed": pipe["canary_passed"],
        "tokens": pipe["tokens"],
        "shards": pipe["shards"],
        "bytes_per_token": pipe["bytes_per_token"],
        "server_args": pipe["server_args"],
    }
    record["train_on_sglang_shards"] = ext["train"]
    record["serve"] = _serve(serve)
    if args.serve_short:
        short = json.loads((args.serve_short / "serve.json").read_text())["modes"]["eagle3"]
        record["serve"]["eagle3_chain1"] = {"startup_s": short["startup_s"], **_levels(short)}
    if args.offline:
        record["offline_eval"] = _offline(json.loads(args.offline.read_text()))
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
    print(
        json.dumps({"speedup": record["serve"]["speedup"], "accept_length": record["serve"]["accept_length"]})
    )


if __name__ == "__main__":
    main()
