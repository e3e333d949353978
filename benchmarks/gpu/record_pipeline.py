"""The H200 pipeline record: GPU seconds per stage, summed over every call, and the drafter's acceptance,
folded from the stage manifests of one run (nothing here measures).

    python benchmarks/pipeline_h200/record.py --home HOME --run smollm2-gpu --job JOB_DIR \\
        --machine "..." --command "..." --out benchmarks/results/h200-pipeline.json

HOME is the pipeline's home on the GPU host (or one restored from its pack-out). A stage's seconds are
what it cost over every call that worked on it (`aerie.plan.track.manifest_seconds`: a resumed generation's
runs and their server starts, a resumed training's runs), the GPU held throughout. JOB_DIR, the host
job's folder, gives each `pipeline-*` step's wall seconds: the `gpuhost run` commands whole, with what no
stage counts (interpreter start, cache checks, pack-outs), the figure to read beside the stages' sum.
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
from pipeline import STAGES, newest_manifests  # noqa: E402

GOAL_GPU_S = 1800  # the whole pipeline in 30 GPU-minutes...
GOAL_MTBENCH_K7 = 3.0  # ...with a drafter that accepts at least 3 tokens a round on MT-Bench (7 steps)


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


def build(home: Path, run: str, job: Path | None) -> dict[str, Any]:
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
            "gpu_seconds_total_max": GOAL_GPU_S,
            "mtbench_k7_min": GOAL_MTBENCH_K7,
            "met": not missing and total <= GOAL_GPU_S and k7 is not None and k7 >= GOAL_MTBENCH_K7,
        },
        "stages": stages,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", required=True, type=Path)
    ap.add_argument("--run", default="smollm2-gpu")
    ap.add_argument("--job", type=Path, help="the host job's folder (its seconds.pipeline-* files)")
    ap.add_argument("--machine", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--note", action="append", default=[])
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": args.machine,
        "command": args.command,
        "notes": args.note,
        **build(args.home, args.run, args.job),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    per_stage = ", ".join(f"{s} {v} s" for s, v in record["gpu_seconds"].items())
    print(f"wrote {args.out}: {per_stage}; total {record['gpu_seconds_total']} s; {record['acceptance']}")


if __name__ == "__main__":
    main()
