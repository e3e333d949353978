"""How close `aerie plan`'s estimates come to what the stages took.

Two presets: the embedded default `smollm2-local`, measured on this machine (the manifests of an `aerie
run smollm2-local` store), and `smollm2-gpu` on an H200, whose actuals are recorded in
benchmarks/results/h200-pipeline.json (every stage, each over every call that worked on it).

What calibrates what (no estimate is fitted to the actual it is compared with):
- smollm2-gpu: rates from other H200 records -- decode_context-h200.json (generation, by mean
  decode context), extract-h200.json (extraction on a synthetic corpus, and the server start-up),
  train_sweep-h200.json (a 3-epoch training of the same preset), pipeline-h200.json (an earlier whole
  run's evaluate stage: the same prompts and settings, another drafter),
  decode-h200.json's eager steps/s (deploy); the token counts come from ShareGPT itself.
- smollm2-gpu's merge: the corpus build's CPU-seconds per token on the H200 host's CPUs (corpus-h200.json).
- smollm2-local: rates from the CPU records (decode-cpu, refserver-cpu, train-cpu, spec_decode-cpu,
  corpus-cpu), recorded on machines of differing speeds, tied to this machine by two *different* local
  runs with a quarter and half of the conversations and epochs: per stage, the line through their
  actuals against the plan's variable part (after the merge, planned from the run's own corpus, as a
  run re-plans) gives its fixed seconds (start-up, loading) and a speed
  factor (`--calibrate STORE_QUARTER STORE_HALF` writes plan_calibration-cpu.json from their manifests;
  aerie/plan/data/calibration.json carries the figures). Evaluation and deployment do the same work in
  both runs, so their factor carries their fixed part too.

    python benchmarks/plan_accuracy.py --calibrate /tmp/recal/q/artifacts /tmp/recal/h/artifacts
    python benchmarks/plan_accuracy.py --local-store /tmp/plan-default/artifacts [--spread-stores MORE ...]
    python benchmarks/plan_accuracy.py   # the smollm2-gpu rows only; the smollm2-local rows are kept
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from aerie.plan import make_plan
from aerie.plan.facts import figure_at
from aerie.plan.machine import gemm_gflops
from aerie.plan.plan import Plan, with_corpus
from aerie.presets import load_config

RESULTS = Path(__file__).parent / "results"
CALIBRATION = Path(__file__).resolve().parents[1] / "aerie" / "plan" / "data" / "calibration.json"
MACHINE = f"{platform.machine()} VM, {os.cpu_count()} CPUs, Python {platform.python_version()}"
STAGES = ("generate", "merge", "extract", "train", "evaluate", "deploy")
# Carried beside a row: what a train step cost, and the extraction's steady rate (against the record's).
STEP_FIGURES = ("steps", "train_tokens", "loop_s", "steady_tokens_per_s")
RUN_FIGURES = (*STEP_FIGURES, "server_start_s")  # carried beside a calibration run
# The calibration runs: a quarter and half of the default's conversations and epochs.
CALIBRATION_RUNS = [
    ["generate.datasets.0.num_samples=6", "train.epochs=3"],
    ["generate.datasets.0.num_samples=12", "train.epochs=6"],
]


def stage_of(directory: str) -> str:
    return "generate" if directory.startswith("generate-") else directory


def store_actuals(store: Path, run: str) -> dict[str, dict[str, Any]]:
    """Each stage's seconds (summed over resumed runs where the manifest sums them) and shard bytes."""
    out: dict[str, dict[str, Any]] = {}
    for manifest in sorted((store / run).glob("*/*/manifest.json")):
        data = json.loads(manifest.read_text())
        seconds = data.get("throughput", {}).get("wall_seconds") or data["seconds"]
        entry = {"seconds": float(seconds), "manifest": str(manifest)}
        stage, figures = data.get("stage"), data.get("figures", {})
        if stage == "extract":
            entry |= {"bytes": figures["bytes"], "steady_tokens_per_s": figures["steady_tokens_per_s"]}
        if "server_start_s" in figures:  # a fixed part the stage measured itself
            entry["server_start_s"] = figures["server_start_s"]
        if stage == "merge":  # the corpus it made, which the calibration plans from
            entry["corpus"] = figures
        if stage == "train":  # its steps, tokens and loop seconds: what a step cost
            entry |= {"steps": figures["steps"], "train_tokens": figures["train_tokens"]}
            entry["loop_s"] = figures["train_wall_s"]
        out[stage_of(manifest.parent.parent.name)] = entry
    return out


def h200_actuals() -> dict[str, dict[str, Any]]:
    """The preset's whole-corpus run (h200-pipeline.json: every stage's seconds over every call that
    worked on it, server starts included)."""
    run = json.loads((RESULTS / "h200-pipeline.json").read_text())
    out = {
        stage_of(name): {"seconds": seconds, "source": f"h200-pipeline.json gpu_seconds.{name}"}
        for name, seconds in run["gpu_seconds"].items()
    }
    out["extract"]["bytes"] = run["stages"]["extract"]["figures"]["bytes"]
    return out


# A complete generation of 3,000 conversations in one call on the H200: the peer run's, whose record keeps
# each stage's seconds. Kept apart from the goal's rows: it ran before the generation's present order and
# batch (longest conversations first, 512 running), in input order at 256, which no plan of today models.
SHORT_RUN_OVERRIDES = ["generate.datasets.0.num_samples=3000"]
SHORT_RUN_RECORD = "peer-drafter-h200.json"
# Full default runs beside the one the goal's rows come from, made with the same code on the same machine.
SPREAD = "another full run of the same code on this machine: how far one run is from the next"


def short_run_row() -> dict[str, Any]:
    plan = make_plan(load_config("smollm2-gpu", SHORT_RUN_OVERRIDES), "h200")
    est = next(e for e in plan.stages if e.stage == "generate")
    actual = json.loads((RESULTS / SHORT_RUN_RECORD).read_text())["stage_seconds"]["generate-sharegpt"]
    return {
        "preset": "smollm2-gpu " + " ".join(SHORT_RUN_OVERRIDES),
        "stage": "generate",
        "unit": "seconds",
        "estimate": round(est.seconds, 1),
        "actual": round(actual, 1),
        "error": round(est.seconds / actual - 1, 3),
        "actual_from": f"{SHORT_RUN_RECORD} stage_seconds.generate-sharegpt (one call)",
        "apart_because": "an earlier generation order and batch: input order at 256 running",
    }


def kept_local_rows(out: Path, key: str) -> list[dict[str, Any]]:
    """The smollm2-local rows of an earlier record's `key`: they need full local pipeline runs to redo."""
    if not out.is_file():
        return []
    return [r for r in json.loads(out.read_text()).get(key, []) if r["preset"] == "smollm2-local"]


def rows(preset: str, plan: Plan, actuals: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for est in plan.stages:
        actual = actuals.get(est.stage)
        if actual is None:
            continue
        out.append(
            {
                "preset": preset,
                "stage": est.stage,
                "unit": "seconds",
                "estimate": round(est.seconds, 1),
                "actual": round(actual["seconds"], 1),
                "error": round(est.seconds / actual["seconds"] - 1, 3),
                "actual_from": actual.get("source") or actual.get("manifest"),
                **{k: actual[k] for k in STEP_FIGURES if k in actual},
            }
        )
    if "bytes" in actuals.get("extract", {}):
        shards = plan.disk.shard_bytes
        out.append(
            {
                "preset": preset,
                "stage": "extract shards",
                "unit": "bytes",
                "estimate": shards,
                "actual": actuals["extract"]["bytes"],
                "error": round(shards / actuals["extract"]["bytes"] - 1, 3),
            }
        )
    return out


def fit(runs: list[tuple[float, float]], measured_fixed: list[float] | None = None) -> tuple[float, float]:
    """(fixed seconds, speed factor) of one stage from its calibration runs' (variable estimate, actual):
    the line through the two where their work differs and the actual follows it.
    - A fixed part the stage measured itself (the generation's server start) is taken as measured, and
      the factor from what is left of each run.
    - Where the work does not differ (evaluation and deployment decode the same prompts in every run),
      the factor carries the fixed part too.
    - Where the work is a sliver of the actual (the merge's tokenizing of a few dozen conversations), or
      the actual does not grow with it, the stage is its fixed part plus the variable part at the
      benchmark's rate: a factor fitted to noise would multiply it. An actual that grows less than the
      work does is a machine faster than the benchmark's, and the line says by how much."""
    if measured_fixed:
        fixed = sum(measured_fixed) / len(measured_fixed)
        return fixed, sum((a - f) / v for (v, a), f in zip(runs, measured_fixed, strict=True)) / len(runs)
    through_zero = 0.0, sum(a / v for v, a in runs) / len(runs)
    (v1, a1), (v2, a2) = sorted(runs)
    if v2 - v1 <= 0.1 * v2:
        return through_zero
    if v2 < 0.05 * a1 or a2 <= a1:
        return sum(a - v for v, a in runs) / len(runs), 1.0
    speed = (a2 - a1) / (v2 - v1)
    fixed = a2 - speed * v2
    return through_zero if fixed < 0 else (fixed, speed)  # no negative start-up


def calibrate(stores: list[Path], out: Path) -> None:
    """Each CPU stage's fixed seconds and speed factor (`fit`) from two calibration runs on this machine,
    against the plan's variable part (the plan made with every fixed part at zero). The stages after
    the merge are planned from the run's own corpus, as a run re-plans them: the factors measure the
    machine, not how far a sample's estimate of the corpus was from it."""
    if len(stores) != len(CALIBRATION_RUNS):
        raise SystemExit(
            f"--calibrate takes {len(CALIBRATION_RUNS)} stores, in the order of CALIBRATION_RUNS"
        )
    per_stage: dict[str, list[dict[str, Any]]] = {}
    for overrides, store in zip(CALIBRATION_RUNS, stores, strict=True):
        actuals = store_actuals(store, "smollm2-local")
        plan = make_plan(load_config("smollm2-local", overrides), "cpu", fixed=False)
        plan = with_corpus(plan, actuals["merge"]["corpus"], fixed=False)
        for est in plan.stages:
            if est.stage in actuals:
                per_stage.setdefault(est.stage, []).append(
                    {
                        "overrides": " ".join(overrides),
                        "actual_s": round(actuals[est.stage]["seconds"], 3),
                        "variable_estimate_s": round(est.seconds, 3),
                        **{k: actuals[est.stage][k] for k in RUN_FIGURES if k in actuals[est.stage]},
                    }
                )
    stages = {}
    for stage, runs in per_stage.items():
        starts = [r["server_start_s"] for r in runs if "server_start_s" in r]
        fixed, speed = fit(
            [(r["variable_estimate_s"], r["actual_s"]) for r in runs],
            starts if len(starts) == len(runs) else None,
        )
        stages[stage] = {"runs": runs, "fixed_s": round(fixed, 1), "speed": round(speed, 3)}
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": MACHINE,
        # The probe a CPU plan repeats to say how far its machine is from this one (aerie.plan.machine).
        "machine_gemm_gflops": round(gemm_gflops(), 1),
        "command": "python benchmarks/plan_accuracy.py --calibrate " + " ".join(map(str, stores)),
        "runs": [f"aerie run smollm2-local --no-prefect {' '.join(o)}" for o in CALIBRATION_RUNS],
        "stages": stages,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(stages, indent=1))
    follow_calibration(record, out.name)


def follow_calibration(record: dict[str, Any], source: str) -> None:
    """Set every figure of aerie/plan/data/calibration.json that cites `source` to the new record's (the
    file keeps one entry a line; tests/test_plan.py checks each against its record)."""
    lines = CALIBRATION.read_text().splitlines(keepends=True)
    for i, line in enumerate(lines):
        if f'"source": "{source}"' not in line:
            continue
        head, entry = line.split(": ", 1)
        body = json.loads(entry.rstrip().rstrip(","))
        body["value"] = figure_at(record, body["path"])
        lines[i] = f"{head}: {json.dumps(body)}{',' if entry.rstrip().endswith(',') else ''}\n"
    CALIBRATION.write_text("".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--local-store", type=Path, help="the store of an `aerie run smollm2-local`")
    parser.add_argument(
        "--spread-stores",
        type=Path,
        nargs="*",
        default=[],
        help="the stores of more such runs on this machine, recorded apart (other_runs): the spread",
    )
    parser.add_argument(
        "--calibrate", type=Path, nargs="+", help="write plan_calibration-cpu.json from these stores"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "plan-accuracy.json")
    args = parser.parse_args()
    if args.calibrate:
        calibrate(args.calibrate, RESULTS / "plan_calibration-cpu.json")
        return
    table = rows("smollm2-gpu", make_plan(load_config("smollm2-gpu", []), "h200"), h200_actuals())
    speed, others = None, [short_run_row()]
    if args.local_store:
        local = make_plan(load_config("smollm2-local", []), "cpu")
        table += rows("smollm2-local", local, store_actuals(args.local_store, "smollm2-local"))
        speed = local.record()["machine"]  # this machine when the CPU rows were planned
        for store in args.spread_stores:
            spread = rows("smollm2-local", local, store_actuals(store, "smollm2-local"))
            others += [{**r, "apart_because": SPREAD} for r in spread]
    else:
        table += kept_local_rows(args.out, "stages")
        others += kept_local_rows(args.out, "other_runs")
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": MACHINE + " (plans need no GPU)",
        "command": "python " + " ".join(sys.argv),
        "calibration": (__doc__ or "").split("What calibrates what")[1].split("    python")[0].strip(),
        "within_25_percent": sum(abs(r["error"]) <= 0.25 for r in table),
        "rows": len(table),
        "stages": table,
        "other_runs": others,
        "cpu_rows_machine": speed,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for r in table:
        print(f"{r['preset']:14s} {r['stage']:15s} {r['estimate']:>14,} {r['actual']:>14,} {r['error']:+.1%}")


if __name__ == "__main__":
    main()
