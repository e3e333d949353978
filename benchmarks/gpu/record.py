"""The peer record: aerie's drafter beside SpecForge 0.2.0's, both trained on one run's extracted
features and measured by one evaluator, folded from what that run wrote (nothing here measures).

    python benchmarks/peer_h200/record.py --home HOME --run smollm2-gpu --specforge specforge-train.json \\
        --pair pair.json --machine "..." --command "..." --out benchmarks/results/peer-drafter-h200.json

HOME is the pipeline's home on the GPU host (or one restored from its pack-out): the stage manifests
give the data both trainers saw and aerie's training time; `specforge-train.json` is what
benchmarks/peer_drafter.py wrote, `pair.json` what benchmarks/peer_h200/evaluate_pair.py wrote.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline import newest_manifests, stage_record  # noqa: E402

GOAL_TIME_RATIO = 0.5  # aerie's τ at least SpecForge's, in at most half its training time


def taus(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{dataset: {"k3": τ, ...}} from the evaluator's results."""
    out: dict[str, dict[str, float]] = {}
    for r in results:
        out.setdefault(r["dataset"], {})[f"k{r['num_steps']}"] = r["accept_length"]
    return out


def per_position(results: list[dict[str, Any]]) -> dict[str, list[float | None]]:
    """{"<dataset>.k<steps>": acceptance at each draft position, given the ones before were accepted}."""
    return {f"{r['dataset']}.k{r['num_steps']}": r["conditional_acceptance"] for r in results}


def data_block(stages: dict[str, dict[str, Any]], specforge: dict[str, Any]) -> dict[str, Any]:
    gen, merge, ext, train = (
        stages[s]["figures"] for s in ("generate-sharegpt", "merge", "extract", "train")
    )
    return {
        "conversations_generated": gen.get("records"),
        "conversations_failed": gen.get("failed"),
        "completion_tokens": gen.get("completion_tokens"),
        "corpus_records": merge.get("records"),
        "train_records": merge.get("train_records"),
        "train_tokens": merge.get("train_tokens"),
        "eval_records": merge.get("eval_records"),
        "supervised_fraction": merge.get("supervised_fraction"),
        "extracted_tokens": ext.get("tokens"),
        "shards": ext.get("shards"),
        "storage_dtype": ext.get("storage_dtype"),
        "draft_vocab_size": train.get("draft_vocab_size"),
        "epochs": stages["train"]["config"]["epochs"],
        "aerie_tokens_trained": train.get("train_tokens"),
        "specforge_samples_per_epoch": specforge["samples"],
        "specforge_tokens_trained": specforge["tokens"],
        "specforge_supervised_tokens_trained": specforge["supervised_tokens"],
    }


def comparison(aerie: dict[str, Any], specforge: dict[str, Any]) -> dict[str, Any]:
    ratio = aerie["train_wall_s"] / specforge["train_wall_s"]
    tau_ok = all(
        aerie["acceptance"][d][k] >= specforge["acceptance"][d][k]
        for d in aerie["acceptance"]
        for k in aerie["acceptance"][d]
    )
    return {
        "train_time_ratio_aerie_over_specforge": round(ratio, 4),
        "tau_difference_aerie_minus_specforge": {
            d: {
                k: round(aerie["acceptance"][d][k] - specforge["acceptance"][d][k], 4)
                for k in aerie["acceptance"][d]
            }
            for d in aerie["acceptance"]
        },
        "aerie_tau_at_least_specforge_everywhere": tau_ok,
        "goal_met": tau_ok and ratio <= GOAL_TIME_RATIO,
    }


def build(args: argparse.Namespace) -> dict[str, Any]:
    manifests = newest_manifests(Path(args.home), args.run)
    needed = ("generate-sharegpt", "merge", "extract", "train")
    missing = [s for s in needed if s not in manifests]
    if missing:
        raise SystemExit(f"{args.home}: run {args.run!r} has no finished {missing}")
    stages = {s: stage_record(s, json.loads(manifests[s].read_text())) for s in needed}
    sf_record = json.loads(Path(args.specforge).read_text())
    sf = sf_record["figures"]["specforge"]
    pair = json.loads(Path(args.pair).read_text())
    train = stages["train"]
    aerie = {
        "acceptance": taus(pair["drafters"]["aerie"]["results"]),
        # From the trainer's start (model build, compile) to its last step, evaluations and checkpoints included.
        "train_wall_s": train["wall_s"],
        "train_stage_s": train["last_run_s"],
        "steps": train["training"].get("total_steps"),
        "tokens": train["training"].get("tokens"),
        "best_step": (train.get("best") or {}).get("step"),
        "lr": train["config"]["lr"],
        "batch_tokens": train["config"]["batch_tokens"],
        "per_position": per_position(pair["drafters"]["aerie"]["results"]),
    }
    specforge = {
        "acceptance": taus(pair["drafters"]["specforge"]["results"]),
        # The training loop alone: the samples were put on the GPU before its clock started (setup_s).
        "train_wall_s": sf["wall_s"],
        "setup_s": sf["setup_s"],
        "steps": sf["steps"],
        "total_steps": sf["total_steps"],
        "stopped_early": sf["stopped_early"],
        "seconds_per_step": sf["seconds_per_step"],
        "tokens_per_s": sf["tokens_per_s"],
        "lr": sf["lr"],
        "batch_size": sf["batch_size"],
        "per_position": per_position(pair["drafters"]["specforge"]["results"]),
    }
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": args.machine,
        "command": args.command,
        "notes": args.note,
        "aerie": aerie,
        "specforge": specforge,
        "comparison": comparison(aerie, specforge),
        "data": data_block(stages, sf),
        "stage_seconds": {s: stages[s]["wall_s"] for s in ("generate-sharegpt", "merge", "extract")},
        "evaluation": {
            "prompts": pair["prompts"],
            "config": pair["config"],
            "device": pair["device"],
            "dtype": pair["dtype"],
            "outputs_identical": f"{pair['agreement']['identical']}/{pair['agreement']['prompts']}",
            "seconds": pair["seconds"],
        },
        "specforge_machine": sf_record["machine"],
        "results": {name: d["results"] for name, d in pair["drafters"].items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", required=True)
    ap.add_argument("--run", default="smollm2-gpu")
    ap.add_argument("--specforge", required=True, help="specforge-train.json")
    ap.add_argument("--pair", required=True, help="the evaluator's pair.json")
    ap.add_argument("--machine", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--note", action="append", default=[])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    record = build(args)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({"aerie": record["aerie"]["acceptance"], "specforge": record["specforge"]["acceptance"],
                      "comparison": record["comparison"]}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
