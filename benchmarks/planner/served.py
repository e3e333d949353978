"""The served check: the prediction written first, then the drafter, SGLang's n-gram speculation and the
plain target served at steady state; the record `results/served-<card>.json`.

    python benchmarks/planner/served.py predict --target NAME --figures FIGURES.json --out DIR [--concurrency 1,8,32,64]
    python benchmarks/planner/served.py serve --server baseline|speculative|ngram --target NAME --drafter DIR --out DIR
    python benchmarks/planner/served.py record --parts DIR [--report deploy/report.json] --drafter-figures FIGURES.json
    python benchmarks/planner/served.py acceptance-map     # -> aerie/plan/data/served_acceptance.json

`predict` writes DIR/prediction.json (aerie.deploy.serving_plan: the cost model at the served accept
length expected from the offline evaluation) before any server starts. `serve` runs one server through
the deploy stage's own launch and benchmark (aerie.deploy.work.server_specs, aerie.deploy.bench at steady
state, repeated), one server a call so each fits a device call, and writes DIR/<server>.json. `record`
joins the prediction and the servers (or one deploy report.json, which holds both) into
results/served-<card>.json: `date`, `machine`, `command`, `drafter` (its offline accept lengths), and per
level `predicted_speedup`, `measured_speedup`, both tokens/s, the n-gram speed-up, SGLang's accept length
and the spread of the repetitions, and whether the prediction landed within 15%.

`acceptance-map` fits served - 1 = slope x (offline - 1) to the pairs on record (the same drafter's
offline accept length at k=3 and the accept length a server measured at k=3) and writes the slope and
its residual spread for aerie/plan/served.py.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
ACCEPTANCE_MAP = ROOT / "aerie" / "plan" / "data" / "served_acceptance.json"
# A prediction "lands" when within this fraction of the measured speed-up.
TOLERANCE = 0.15


def _deploy_config(a: argparse.Namespace) -> Any:
    from aerie.deploy.config import DeployConfig

    return DeployConfig(
        concurrency=[int(c) for c in a.concurrency.split(",")],
        num_prompts=a.num_prompts,
        max_new_tokens=a.max_new_tokens,
        num_steps=a.num_steps,
        level_seconds=a.level_seconds,
        requests_per_slot=a.requests_per_slot,
        repeats=a.repeats,
        ngram="on",
    )


def _server(a: argparse.Namespace) -> Any:
    from aerie.serving import ServerConfig

    return ServerConfig(backend="sglang", port=a.port, extra_args=a.sglang_args.split())


def predict(a: argparse.Namespace) -> int:
    import torch  # noqa: F401  # the card is read from a loaded torch (aerie.plan.served.this_card)

    from aerie.deploy.serving_plan import serving_plan
    from aerie.targets import resolve_target

    figures = json.loads(Path(a.figures).read_text()) if a.figures else {}
    target = resolve_target(a.target)
    plan = serving_plan(_deploy_config(a), _server(a), target, figures, "EAGLE3")  # the EAGLE-3 drafter
    plan["written"] = datetime.now(UTC).isoformat(timespec="seconds")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prediction.json").write_text(json.dumps(plan, indent=2))
    print(json.dumps(plan["tiers"], indent=2))
    return 0


def serve(a: argparse.Namespace) -> int:
    from aerie.deploy.work import _benchmark_server, server_specs
    from aerie.evaluate.prompts import mtbench_prompts
    from aerie.targets import resolve_target

    cfg, target = _deploy_config(a), resolve_target(a.target)
    prompts = [p.input_ids for p in mtbench_prompts(target.load_tokenizer(), None, 4096)]
    prompts = [prompts[i % len(prompts)] for i in range(cfg.num_prompts)]
    spec = server_specs(cfg, _server(a), target, str(Path(a.drafter).resolve()))[a.server]
    results, _, engine = _benchmark_server(a.server, spec, prompts, cfg, lambda f, m: print(m, flush=True))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    part = {
        "server": a.server,
        "command": spec.describe(),
        "engine_accept_length": engine,
        "num_steps": cfg.num_steps,
        "steady_state": {
            "level_seconds": cfg.level_seconds,
            "requests_per_slot": cfg.requests_per_slot,
            "repeats": cfg.repeats,
        },
        "rows": [r.to_dict() for r in results],
    }
    (out / f"{a.server}.json").write_text(json.dumps(part, indent=2))
    return 0


def _parts(a: argparse.Namespace) -> tuple[dict[str, Any] | None, list[dict[str, Any]], dict[str, Any]]:
    """(prediction, rows, extra) from a deploy report, or from `predict` and `serve` parts."""
    if a.report:
        report = json.loads(Path(a.report).read_text())
        return report.get("prediction"), report["rows"], report
    parts = Path(a.parts)
    prediction_file = parts / "prediction.json"
    prediction = json.loads(prediction_file.read_text()) if prediction_file.exists() else None
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {"servers": {}, "engine_accept_length": {}}
    for name in ("baseline", "speculative", "ngram"):
        path = parts / f"{name}.json"
        if path.exists():
            part = json.loads(path.read_text())
            rows += part["rows"]
            extra["servers"][name] = {"command": part["command"]}
            extra["engine_accept_length"][name] = part["engine_accept_length"]
            extra["num_steps"] = part.get("num_steps", extra.get("num_steps"))
            extra["steady_state"] = part.get("steady_state")
    return prediction, rows, extra


def levels(prediction: dict[str, Any] | None, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per measured level: predicted against measured."""
    by = {(r["server"], r["concurrency"]): r for r in rows}
    tiers = {t["concurrency"]: t for t in (prediction or {}).get("tiers", [])}
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        base, spec, ngram = by.get(("baseline", c)), by.get(("speculative", c)), by.get(("ngram", c))
        if base is None:
            continue
        tier = tiers.get(c, {})
        measured = None if spec is None else spec["output_tokens_per_s"] / base["output_tokens_per_s"]
        predicted = tier.get("predicted_speedup")
        error = None if measured is None or predicted is None else predicted / measured - 1.0
        out.append(
            {
                "concurrency": c,
                "predicted_speedup": predicted,
                "predicted_speedup_range": tier.get("predicted_speedup_range"),
                "predicted_num_steps": tier.get("num_steps"),
                "prediction_flags": tier.get("flags", []),
                "measured_speedup": None if measured is None else round(measured, 4),
                "prediction_error": None if error is None else round(error, 4),
                "within_15_percent": None if error is None else abs(error) <= TOLERANCE,
                "baseline_tokens_per_s": base["output_tokens_per_s"],
                "speculative_tokens_per_s": None if spec is None else spec["output_tokens_per_s"],
                "ngram_tokens_per_s": None if ngram is None else ngram["output_tokens_per_s"],
                "ngram_speedup": None
                if ngram is None
                else round(ngram["output_tokens_per_s"] / base["output_tokens_per_s"], 4),
                "served_accept_length": None if spec is None else spec.get("accept_length"),
                "ngram_accept_length": None if ngram is None else ngram.get("accept_length"),
                "spread": {
                    name: r.get("spread")
                    for name, r in (("baseline", base), ("speculative", spec), ("ngram", ngram))
                    if r is not None
                },
                "tokens_per_s_runs": {
                    name: r.get("tokens_per_s_runs")
                    for name, r in (("baseline", base), ("speculative", spec), ("ngram", ngram))
                    if r is not None
                },
            }
        )
    return out


def record(a: argparse.Namespace) -> int:
    prediction, rows, extra = _parts(a)
    figures = json.loads(Path(a.drafter_figures).read_text()) if a.drafter_figures else {}
    drafter = {
        "path": a.drafter_name,
        "accept_lengths": {k: v for k, v in figures.items() if k.startswith("accept_")},
    }
    result = {
        "benchmark": "served",
        "date": a.date or datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": a.machine,
        "card": a.card,
        "command": a.command,
        "drafter": drafter,
        "num_steps": extra.get("num_steps"),
        "steady_state": extra.get("steady_state"),
        "servers": extra.get("servers"),
        "engine_accept_length": extra.get("engine_accept_length"),
        "prediction_written": (prediction or {}).get("written"),
        "prediction": prediction,
        "levels": levels(prediction, rows),
    }
    path = Path(a.out) if a.out else RESULTS / f"served-{a.card}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    for lvl in result["levels"]:
        print(
            f"c{lvl['concurrency']}: predicted {lvl['predicted_speedup']}, measured {lvl['measured_speedup']}, "
            f"n-gram {lvl['ngram_speedup']}, accept {lvl['served_accept_length']}"
        )
    return 0


# ---------------------------------------------------------------- offline -> served acceptance


def acceptance_pairs() -> list[dict[str, Any]]:
    """(offline k=3, served k=3) accept lengths of one drafter, from the records that hold both."""
    pairs = []
    sglang = json.loads((RESULTS / "sglang-h200.json").read_text())
    served = sglang["serve"]["accept_length_by_level"]
    pairs.append(
        {
            "record": "sglang-h200.json",
            "server": "SGLang 0.5.23, bf16, 192 new tokens",
            "offline": sglang["offline_eval"]["k3"]["accept_length"],
            "served": statistics.fmean(served.values()),
        }
    )
    pipeline = json.loads((RESULTS / "h200-pipeline.json").read_text())["stages"]
    deployed = pipeline["deploy"]["figures"]
    pairs.append(
        {
            "record": "h200-pipeline.json",
            "server": "aerie's reference server, deploy stage, 128 new tokens",
            "offline": pipeline["evaluate"]["figures"]["accept_mtbench_eagle3_k3"],
            "served": statistics.fmean(v for k, v in deployed.items() if k.startswith("accept_length_c")),
        }
    )
    kimi = json.loads((RESULTS / "targets_gpu-h100.json").read_text())["targets"]["kimi"]["stages"]
    pairs.append(
        {
            "record": "targets_gpu-h100.json (kimi-shaped, random weights)",
            "server": "aerie's reference server, deploy stage, 16 new tokens",
            "offline": kimi["evaluate"]["figures"]["accept_heldout_eagle3_k3"],
            "served": statistics.fmean(
                v for k, v in kimi["deploy"]["figures"].items() if k.startswith("accept_length_c")
            ),
        }
    )
    return pairs


def acceptance_map(a: argparse.Namespace) -> int:
    pairs = acceptance_pairs()
    xs = [p["offline"] - 1.0 for p in pairs]
    ys = [p["served"] - 1.0 for p in pairs]
    slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    residuals = [y - slope * x for x, y in zip(xs, ys, strict=True)]
    sd = math.sqrt(sum(r * r for r in residuals) / (len(pairs) - 1)) if len(pairs) > 1 else 0.0
    found = {
        "about": "served accept length - 1 = slope x (offline accept length - 1), k=3, fitted through the "
        "origin to the pairs on record by benchmarks/planner/served.py acceptance-map; residual_sd: the spread "
        "of the served accept length around the map, in tokens per round",
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "slope": round(slope, 4),
        "residual_sd": round(sd, 4),
        "pairs_used": len(pairs),
        "pairs": [
            {**p, "mapped": round(1.0 + slope * (p["offline"] - 1.0), 4), "residual": round(r, 4)}
            for p, r in zip(pairs, residuals, strict=True)
        ],
        "quality": "few pairs, three servers and answer lengths: the map says which way and roughly how "
        "far served acceptance falls below offline; per-pair slopes "
        + ", ".join(f"{y / x:.2f}" for x, y in zip(xs, ys, strict=True)),
    }
    ACCEPTANCE_MAP.write_text(json.dumps(found, indent=2) + "\n")
    print(json.dumps(found, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--target", default="smollm2-135m-instruct")
    common.add_argument("--concurrency", default="1,8,32,64")
    common.add_argument("--num-prompts", type=int, default=64)
    common.add_argument("--max-new-tokens", type=int, default=128)
    common.add_argument("--num-steps", type=int, default=3)
    common.add_argument("--level-seconds", type=float, default=20.0)
    common.add_argument("--requests-per-slot", type=int, default=8)
    common.add_argument("--repeats", type=int, default=3)
    common.add_argument("--port", type=int, default=31000)
    common.add_argument("--sglang-args", default="", help="extra SGLang launch arguments (one string)")
    common.add_argument("--out", required=True)
    p = sub.add_parser("predict", parents=[common])
    p.add_argument("--figures", help="the evaluate stage's figures (JSON): accept_<dataset>_eagle3_k<k>")
    s = sub.add_parser("serve", parents=[common])
    s.add_argument("--server", required=True, choices=["baseline", "speculative", "ngram"])
    s.add_argument("--drafter", required=True)
    r = sub.add_parser("record")
    r.add_argument("--parts", help="the directory predict and serve wrote")
    r.add_argument("--report", help="a deploy stage's report.json instead of parts")
    r.add_argument("--drafter-figures", help="the evaluate stage's figures (JSON)")
    r.add_argument("--drafter-name", default="smollm2-gpu promoted drafter")
    r.add_argument("--card", required=True)
    r.add_argument("--machine", required=True)
    r.add_argument("--command", required=True)
    r.add_argument("--date")
    r.add_argument("--out")
    sub.add_parser("acceptance-map")
    a = ap.parse_args()
    if a.cmd == "record" and not (a.parts or a.report):
        ap.error("record needs --parts or --report")
    return {"predict": predict, "serve": serve, "record": record, "acceptance-map": acceptance_map}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
