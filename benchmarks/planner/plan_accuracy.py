"""How close `aerie plan`'s estimates come to what the stages took: calibration rows and validation rows.

- `calibration`: runs the plan's figures were fitted to, or that were in view while its model was
  revised; they show how well the model fits, not how well it predicts. Each row says why it is here.
- `validation`: runs made after the model was settled, of another size, preset or machine than any
  calibration run, whose estimate is the plan printed before the run started (`aerie plan ... --json`),
  with the machine's load while it ran. Every validation row is kept, misses included; a stage whose
  work is the same as a calibration run's (so that its estimate would be an earlier timing of the
  same work) is not a validation row.

What calibrates what:
- smollm2-gpu: rates from other H200 records -- decode_context-h200.json (generation, by mean
  decode context), extract-h200.json (extraction on a synthetic corpus, and the server start-up),
  train_sweep-h200.json (a 3-epoch training of the same preset), pipeline-h200.json (an earlier whole
  run's evaluate stage: the same prompts and settings, another drafter),
  decode-h200.json's eager steps/s (deploy); the token counts come from ShareGPT itself.
- smollm2-gpu's merge: the corpus build's CPU-seconds per token on the H200 host's CPUs (corpus-h200.json).
- smollm2-local: rates from the CPU records (decode-cpu, refserver-cpu, train-cpu, spec_decode-cpu,
  corpus-cpu), recorded on machines of differing speeds, tied to one machine by two local runs with a
  quarter and half of the conversations and epochs: per stage, the line through their actuals against
  the plan's variable part (after the merge, planned from the run's own corpus, as a run re-plans)
  gives its fixed seconds (start-up, loading) and a speed factor (`--calibrate STORE_QUARTER
  STORE_HALF` writes plan_calibration-cpu.json from their manifests; aerie/plan/data/calibration.json
  carries the figures). Evaluation and deployment do the same work in both runs, so their factor
  carries their fixed part too.

    python benchmarks/planner/plan_accuracy.py --calibrate /tmp/recal/q/artifacts /tmp/recal/h/artifacts
    python benchmarks/planner/plan_accuracy.py --validate STORE --plan PLAN.json --load LOAD.txt --overrides "k=v ..."
    python benchmarks/planner/plan_accuracy.py   # recompute the smollm2-gpu calibration rows; the rest is kept
    python benchmarks/planner/plan_accuracy.py --quote   # rewrite the READMEs' and docs/plan.md's rows from it
    bash benchmarks/gpu/job.sh plan-validate [PRESET k=v ...]   # a validation run: its plan, the run, its rows
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

from plan_quotes import quote  # the script's own folder is on sys.path

from aerie.plan import make_plan
from aerie.plan.facts import figure_at
from aerie.plan.machine import gemm_gflops
from aerie.plan.plan import Plan, with_corpus
from aerie.presets import load_config

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parents[1] / "results"
CALIBRATION = ROOT / "aerie" / "plan" / "data" / "calibration.json"
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
# each stage's seconds. It ran before the generation's present order and batch (longest conversations
# first, 512 running), in input order at 256, and was in view while the generation model was revised.
SHORT_RUN_OVERRIDES = ["generate.datasets.0.num_samples=3000"]
SHORT_RUN_RECORD = "peer-drafter-h200.json"
WHY_H200 = "the H200 model was revised while this run's actuals were known"
WHY_H200_EVALUATE = "its estimate is an earlier whole run's evaluate stage: the same prompts and settings"
WHY_SHORT = "in view while the generation model was revised; an earlier generation order (input order, 256)"
WHY_CPU_FULL = (
    "a full default run made after the last recalibration, but the CPU model had been revised after "
    "earlier such runs were seen"
)
WHY_CPU_SAME_WORK = "the same prompts as both calibration runs: its estimate is their timing of the same work"
SAME_WORK_STAGES = ("evaluate", "deploy")  # the default's and the calibration runs' prompts are the same


def short_run_row() -> dict[str, Any]:
    plan = make_plan(load_config("smollm2-gpu", SHORT_RUN_OVERRIDES), "h200")
    est = next(e for e in plan.stages if e.stage == "generate")
    actual = json.loads((RESULTS / SHORT_RUN_RECORD).read_text())["stage_seconds"]["generate-sharegpt"]
    return {
        "preset": "smollm2-gpu " + " ".join(SHORT_RUN_OVERRIDES),
        "hardware": "h200",
        "stage": "generate",
        "unit": "seconds",
        "estimate": round(est.seconds, 1),
        "actual": round(actual, 1),
        "error": round(est.seconds / actual - 1, 3),
        "actual_from": f"{SHORT_RUN_RECORD} stage_seconds.generate-sharegpt (one call)",
        "why_calibration": WHY_SHORT,
    }


def fit_rows() -> list[dict[str, Any]]:
    """The two CPU calibration runs against the line fitted through them (exact where two points fix it)."""
    record = json.loads((RESULTS / "plan_calibration-cpu.json").read_text())
    out = []
    for stage, fitted in record["stages"].items():
        for run in fitted["runs"]:
            estimate = fitted["fixed_s"] + fitted["speed"] * run["variable_estimate_s"]
            out.append(
                {
                    "preset": f"smollm2-local {run['overrides']}",
                    "hardware": "cpu",
                    "stage": stage,
                    "unit": "seconds",
                    "estimate": round(estimate, 1),
                    "actual": round(run["actual_s"], 1),
                    "error": round(estimate / run["actual_s"] - 1, 3),
                    "actual_from": "plan_calibration-cpu.json",
                    "why_calibration": "fitted: the stage's fixed seconds and speed factor come from this run",
                }
            )
    return out


def kept_rows(out: Path, key: str, preset_prefix: str) -> list[dict[str, Any]]:
    """An earlier record's `key` rows of one preset (runs that need a whole pipeline to redo)."""
    if not out.is_file():
        return []
    return [r for r in json.loads(out.read_text()).get(key, []) if r["preset"].startswith(preset_prefix)]


def rows(preset: str, plan: Plan, actuals: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for est in plan.stages:
        actual = actuals.get(est.stage)
        if actual is None:
            continue
        out.append(
            {
                "preset": preset,
                "hardware": plan.hardware.name,
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
                "hardware": plan.hardware.name,
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
        "command": "python benchmarks/planner/plan_accuracy.py --calibrate " + " ".join(map(str, stores)),
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


def h200_calibration() -> list[dict[str, Any]]:
    table = rows("smollm2-gpu", make_plan(load_config("smollm2-gpu", []), "h200"), h200_actuals())
    for r in table:
        r["why_calibration"] = WHY_H200_EVALUATE if r["stage"] == "evaluate" else WHY_H200
    return [*table, short_run_row()]


def mean_load(path: Path, start: str, end: str) -> dict[str, Any]:
    """The 1-minute load average sampled while the run ran (`date +%s` and /proc/loadavg's first field)."""
    t0 = datetime.fromisoformat(start.replace("Z", "+00:00")).timestamp()
    t1 = datetime.fromisoformat(end.replace("Z", "+00:00")).timestamp()
    samples = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and t0 <= float(parts[0]) <= t1:
            samples.append(float(parts[1]))
    if not samples:
        return {"samples": 0}
    return {
        "samples": len(samples),
        "load_1m_mean": round(sum(samples) / len(samples), 2),
        "load_1m_max": round(max(samples), 2),
        "cores": os.cpu_count(),
    }


# The runs the plan was fitted to or revised against, by preset: a validation run must be none of them.
CALIBRATED = {
    "smollm2-local": [[], *CALIBRATION_RUNS],
    "smollm2-gpu": [[], SHORT_RUN_OVERRIDES],
}


def same_work_stages(preset: str, overrides: list[str]) -> list[str]:
    """The stages whose settings equal a calibration run's (evaluation and deployment decode the same
    prompts whatever the run's size): their estimate would be an earlier timing of the same work. A run
    whose whole config is a calibration run's is refused."""
    mine = load_config(preset, overrides).model_dump(mode="json")
    seen = [load_config(preset, o).model_dump(mode="json") for o in CALIBRATED.get(preset, [])]
    if mine in seen:
        raise SystemExit(
            f"{preset} {' '.join(overrides)}: the config of a calibration run, so not a validation run; "
            "change its size (generate.datasets.0.num_samples, train.epochs) or another setting"
        )
    return [stage for stage in SAME_WORK_STAGES if any(mine[stage] == cfg[stage] for cfg in seen)]


def validation_rows(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One fresh run against the plan printed before it started (its --json), with the machine's load:
    (its rows, the stages left out as the same work as a calibration run's)."""
    overrides = args.overrides.split()
    left_out = same_work_stages(args.preset, overrides)
    run_name = load_config(args.preset, overrides).run
    before = json.loads(args.plan.read_text())
    actuals = store_actuals(args.validate, run_name)
    if not actuals:
        raise SystemExit(f"{args.validate / run_name}: no stage manifest; did the run finish?")
    times = {k: (args.validate.parent / k).read_text().strip() for k in ("start", "end", "commit")}
    load = mean_load(args.load, times["start"], times["end"]) if args.load else {}
    replanned = {
        stage_of(m.parent.parent.name): json.loads(m.read_text()).get("plan", {}).get("estimate_s")
        for m in (args.validate / run_name).glob("*/*/manifest.json")
    }
    preset = f"{args.preset} {' '.join(overrides)}".strip()
    common = {
        "preset": preset,
        "hardware": before["hardware"],
        "run": {"start": times["start"], "end": times["end"], "model_commit": times["commit"]},
        "machine_at_plan": before.get("machine"),
        "load_while_running": load,
    }
    out, skipped = [], []
    for est in before["stages"]:
        actual = actuals.get(est["stage"])
        if actual is None:
            continue
        if est["stage"] in left_out:
            why = "the same settings as a calibration run: its estimate is their timing of the same work"
            skipped.append({"preset": preset, "stage": est["stage"], "why": why})
            continue
        out.append(
            {
                **common,
                "stage": est["stage"],
                "unit": "seconds",
                "estimate": round(est["seconds"], 1),
                "actual": round(actual["seconds"], 1),
                "error": round(est["seconds"] / actual["seconds"] - 1, 3),
                "estimate_after_merge": replanned.get(est["stage"]),
                "actual_from": actual["manifest"],
            }
        )
    shards, written = before.get("shard_bytes"), actuals.get("extract", {}).get("bytes")
    if shards and written:
        out.append(
            {
                **common,
                "stage": "extract shards",
                "unit": "bytes",
                "estimate": shards,
                "actual": written,
                "error": round(shards / written - 1, 3),
            }
        )
    return out, skipped


def summary(table: list[dict[str, Any]]) -> dict[str, Any]:
    timed = [r for r in table if r["unit"] == "seconds"]
    worst = max(timed, key=lambda r: abs(r["error"]), default=None)
    return {
        "rows": len(timed),
        "within_25_percent": sum(abs(r["error"]) <= 0.25 for r in timed),
        "worst": {k: worst[k] for k in ("preset", "stage", "error")} if worst else None,
    }


def calibration_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The H200 rows recomputed, the fitted CPU rows, and the full default CPU runs (from their stores,
    or kept from the record)."""
    calibration = [*h200_calibration(), *fit_rows()]
    if args.local_store:
        local = make_plan(load_config("smollm2-local", []), "cpu")
        for store in [args.local_store, *args.spread_stores]:
            for r in rows("smollm2-local", local, store_actuals(store, "smollm2-local")):
                same = r["stage"] in SAME_WORK_STAGES
                calibration.append({**r, "why_calibration": WHY_CPU_SAME_WORK if same else WHY_CPU_FULL})
    else:
        for r in kept_rows(args.out, "calibration", "smollm2-local"):
            if "=" not in r["preset"]:  # a full default run (the fitted runs are rows of fit_rows)
                same = r["stage"] in SAME_WORK_STAGES
                r.setdefault("why_calibration", WHY_CPU_SAME_WORK if same else WHY_CPU_FULL)
                calibration.append(r)
    return calibration


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--local-store", type=Path, help="a full default run's store: a calibration row")
    parser.add_argument("--spread-stores", type=Path, nargs="*", default=[], help="more such stores")
    parser.add_argument(
        "--calibrate", type=Path, nargs="+", help="write plan_calibration-cpu.json from these stores"
    )
    parser.add_argument("--validate", type=Path, help="the store of a fresh run to validate against")
    parser.add_argument("--plan", type=Path, help="the plan printed before that run (aerie plan --json)")
    parser.add_argument("--load", type=Path, help="its load samples: `date +%%s` and /proc/loadavg lines")
    parser.add_argument("--preset", default="smollm2-local", help="the validation run's preset")
    parser.add_argument("--overrides", default="", help="the run's overrides, as one string")
    parser.add_argument("--out", type=Path, default=RESULTS / "plan-accuracy.json")
    parser.add_argument(
        "--docs", type=Path, default=ROOT, help="the checkout whose READMEs and docs/plan.md quote the rows"
    )
    parser.add_argument("--quote", action="store_true", help="only rewrite what quotes the record (--docs)")
    args = parser.parse_args()
    if args.quote:
        quote(json.loads(args.out.read_text()), args.out.name, args.docs)
        return
    if args.calibrate:
        calibrate(args.calibrate, RESULTS / "plan_calibration-cpu.json")
        return
    validation = kept_rows(args.out, "validation", "")
    left_out = kept_rows(args.out, "validation_left_out", "")
    if args.validate:
        # A validation run adds its rows; the calibration rows stay as they are.
        calibration = kept_rows(args.out, "calibration", "")
        new, skipped = validation_rows(args)
        validation, left_out = [*validation, *new], [*left_out, *skipped]
    else:
        calibration = calibration_rows(args)
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": MACHINE + " (plans need no GPU)",
        "command": "python " + " ".join(sys.argv),
        "method": (__doc__ or "").split("    python")[0].strip(),
        "validation_summary": summary(validation),
        "validation": validation,
        "validation_left_out": left_out,
        "calibration_summary": summary(calibration),
        "calibration": calibration,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    quote(record, args.out.name, args.docs)
    for name, table in (("validation", validation), ("calibration", calibration)):
        print(name)
        for r in table:
            print(
                f"  {r['preset'][:60]:60s} {r['stage']:15s} {r['estimate']:>14,} {r['actual']:>14,} {r['error']:+.1%}"
            )


if __name__ == "__main__":
    main()
