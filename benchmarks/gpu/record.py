"""Records of the GPU-host jobs, folded from what a job wrote (nothing here measures):

    python benchmarks/gpu/record.py peer --home HOME --run smollm2-gpu --specforge specforge-train.json \\
        --pair pair.json --machine "..." --command "..." --out benchmarks/results/peer-drafter-h200.json
    python benchmarks/gpu/record.py pipeline --home HOME --run smollm2-gpu --job JOB_DIR \\
        --machine "..." --command "..." --out benchmarks/results/h200-pipeline.json
    python benchmarks/gpu/record.py sglang --extract DIR --serve DIR [--serve-short DIR] [--offline FILE] --date D

HOME is the pipeline's home on the GPU host (or one restored from its pack-out). `peer`: aerie's drafter
beside SpecForge's, from the stage manifests, benchmarks/quality/peer_drafter.py's specforge-train.json and
evaluate_pair.py's pair.json. `pipeline`: each stage's GPU seconds over every call that worked on it
(`aerie.plan.track.manifest_seconds`) and the drafter's acceptance; JOB_DIR's `seconds.pipeline-*` give each
`gpuhost run` command's wall seconds whole (interpreter start, cache checks, pack-outs included). `sglang`:
what the sgl-extract / sgl-serve jobs wrote (extract.json, serve.json) and `aerie evaluate --json`'s report
(--offline), into results/sglang-h200.json beside its earlier `extract` block.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from aerie.plan.track import manifest_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline import STAGES, newest_manifests, stage_record  # noqa: E402

SGLANG_RECORD = Path(__file__).resolve().parents[1] / "results" / "sglang-h200.json"
LEVELS = ("c1", "c8", "c32")
PEER_GOAL_TIME_RATIO = 0.5  # aerie's τ at least SpecForge's, in at most half its training time
PIPELINE_GOAL_GPU_S = 1800  # the whole pipeline in 30 GPU-minutes...
PIPELINE_GOAL_MTBENCH_K7 = (
    3.0  # ...with a drafter that accepts at least 3 tokens a round on MT-Bench (7 steps)
)


# ---- peer
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
        "goal_met": tau_ok and ratio <= PEER_GOAL_TIME_RATIO,
    }


def peer_record(args: argparse.Namespace) -> dict[str, Any]:
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


# ---- pipeline
def acceptance(figures: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{"mtbench": {"k3": τ, "k7": τ}, "heldout": {...}}: the EAGLE-3 drafter's, greedy."""
    out: dict[str, dict[str, float]] = {}
    for dataset in ("mtbench", "heldout"):
        for k in (3, 7):
            value = figures.get(f"accept_{dataset}_eagle3_k{k}")
            if value is not None:
                out.setdefault(dataset, {})[f"k{k}"] = value
    return out


def host_steps(job: Path) -> dict[str, float]:
    return {p.name.split(".", 1)[1]: float(p.read_text()) for p in sorted(job.glob("seconds.pipeline-*"))}


def pipeline_record(args: argparse.Namespace) -> dict[str, Any]:
    home, run, job = args.home, args.run, args.job
    manifests = {s: json.loads(p.read_text()) for s, p in newest_manifests(home, run).items()}
    stages = {
        s: {
            "gpu_s": round(manifest_seconds(m, float(m.get("seconds", 0.0))), 1),
            "runs": m.get("throughput", {}).get("runs", 1),
            "figures": m.get("figures", {}),
        }
        for s, m in manifests.items()
    }
    total = round(sum(s["gpu_s"] for s in stages.values()), 1)
    accept = acceptance(stages.get("evaluate", {}).get("figures", {}))
    k7 = accept.get("mtbench", {}).get("k7")
    missing = [s for s in STAGES if s not in stages]
    return {
        "stages_missing": missing,
        "gpu_seconds_total": total,
        "gpu_seconds": {s: v["gpu_s"] for s, v in stages.items()},
        "host_steps_s": host_steps(job) if job else {},
        "acceptance": accept,
        "goal": {
            "gpu_seconds_total_max": PIPELINE_GOAL_GPU_S,
            "mtbench_k7_min": PIPELINE_GOAL_MTBENCH_K7,
            "met": not missing
            and total <= PIPELINE_GOAL_GPU_S
            and k7 is not None
            and k7 >= PIPELINE_GOAL_MTBENCH_K7,
        },
        "stages": stages,
    }


# ---- sglang
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


def sglang_record(args: argparse.Namespace) -> None:
    record = json.loads(SGLANG_RECORD.read_text())
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
    SGLANG_RECORD.write_text(json.dumps(record, indent=2) + "\n")
    print(
        json.dumps({"speedup": record["serve"]["speedup"], "accept_length": record["serve"]["accept_length"]})
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="job", required=True)
    folded = argparse.ArgumentParser(add_help=False)  # a record made whole from one job's files
    folded.add_argument("--home", required=True, type=Path)
    folded.add_argument("--run", default="smollm2-gpu")
    folded.add_argument("--machine", required=True)
    folded.add_argument("--command", required=True)
    folded.add_argument("--note", action="append", default=[])
    folded.add_argument("--out", required=True, type=Path)
    peer = sub.add_parser("peer", parents=[folded])
    peer.add_argument("--specforge", required=True, help="specforge-train.json")
    peer.add_argument("--pair", required=True, help="the evaluator's pair.json")
    pipe = sub.add_parser("pipeline", parents=[folded])
    pipe.add_argument("--job", type=Path, help="the job's work folder (its seconds.pipeline-* files)")
    sgl = sub.add_parser("sglang")
    sgl.add_argument("--extract", type=Path, required=True)
    sgl.add_argument("--serve", type=Path, required=True)
    sgl.add_argument("--serve-short", type=Path, help="a second eagle3-only serve run (shorter chain)")
    sgl.add_argument("--offline", type=Path)
    sgl.add_argument("--date", required=True)
    args = ap.parse_args()
    if args.job == "sglang":
        sglang_record(args)
        return
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": args.machine,
        "command": args.command,
        "notes": args.note,
        **(peer_record(args) if args.job == "peer" else pipeline_record(args)),
    }
    args.out.write_text(json.dumps(record, indent=2 if args.job == "peer" else 1) + "\n")
    if args.job == "peer":
        summary = {k: record[k]["acceptance"] for k in ("aerie", "specforge")} | {
            "comparison": record["comparison"]
        }
        print(json.dumps(summary, indent=2))
    else:
        per_stage = ", ".join(f"{s} {v} s" for s, v in record["gpu_seconds"].items())
        print(f"wrote {args.out}: {per_stage}; total {record['gpu_seconds_total']} s; {record['acceptance']}")


if __name__ == "__main__":
    main()
