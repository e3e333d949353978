"""The pipeline record: one end-to-end run's figures, read from its stage manifests.

    .venv/bin/python -m tools.gpuhost restore --home /tmp/h .stage/state
    .venv/bin/python benchmarks/pipeline.py --home /tmp/h --run smollm2-gpu \
        --machine "one NVIDIA H200 ..." --command "how the stages were run" [--note TEXT ...]

The stages ran on the GPU host (`python -m tools.gpuhost run`, docs/gpu-host.md), which packs their
manifests out; nothing here measures anything. Every figure is copied from a manifest the stage
wrote, with each stage's own wall time (`seconds`), so the record cannot drift from what ran. Writes
benchmarks/results/pipeline-h200.json and copies the evaluate and deploy reports and the plots into
benchmarks/results/pipeline-h200/.
"""

from __future__ import annotations

import argparse
import json
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
STAGES = ("generate-sharegpt", "merge", "extract", "train", "evaluate", "deploy")
# Per stage, the report files worth keeping beside the record (copied as <stage>-<name>).
REPORTS = {
    "train": ("loss.png", "accuracy.png"),
    "evaluate": ("report.md", "acceptance.png"),
    "deploy": ("report.md",),
}


def newest_manifests(home: Path, run: str) -> dict[str, Path]:
    """The newest manifest of each stage of `run` (by the time the stage wrote it)."""
    found: dict[str, tuple[float, Path]] = {}
    for root in (home / "results" / run, home / "store" / run):
        for path in root.glob("*/*/manifest.json"):
            m = json.loads(path.read_text())
            stage, created = m.get("stage"), float(m.get("created_unix", 0))
            if stage in STAGES and (stage not in found or created > found[stage][0]):
                found[stage] = (created, path)
    return {stage: path for stage, (_, path) in found.items()}


def stage_record(stage: str, m: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"key": m["key"], "wall_s": m.get("seconds"), "figures": m.get("figures", {})}
    if stage == "train":
        # A training that spanned several budgeted runs: its wall time over all of them (newer manifests
        # carry it; the manifest's `seconds` is the last run's share).
        out["wall_s"] = m["training"].get("wall_s") or out["wall_s"]
        out["last_run_s"] = m.get("seconds")
        out["best"] = m.get("best")
        out["training"] = {k: v for k, v in m["training"].items() if k != "config"}
        out["config"] = m["training"].get("config")
    elif stage in ("merge", "extract", "evaluate"):
        out["config"] = m.get("config")
    if stage == "evaluate":
        out["results"] = m.get("results")
        out["agreement"] = m.get("agreement")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--home", required=True, help="a home restored by `python -m tools.gpuhost restore`")
    ap.add_argument("--run", default="smollm2-gpu")
    ap.add_argument("--machine", required=True)
    ap.add_argument("--command", required=True, help="how the stages were run, for the record")
    ap.add_argument("--note", action="append", default=[])
    ap.add_argument("--out", default=str(RESULTS / "pipeline-h200.json"))
    args = ap.parse_args()

    home = Path(args.home)
    manifests = newest_manifests(home, args.run)
    if not manifests:
        raise SystemExit(f"no stage manifests of run {args.run!r} under {home}")
    stages = {s: stage_record(s, json.loads(manifests[s].read_text())) for s in STAGES if s in manifests}
    walls = [s["wall_s"] for s in stages.values() if s["wall_s"] is not None]
    record = {
        "date": datetime.now(timezone.utc).date().isoformat(),
        "machine": args.machine,
        "command": args.command,
        "notes": args.note,
        "stages_missing": [s for s in STAGES if s not in stages],
        "pipeline_wall_s": round(sum(walls), 1),
        "stages": stages,
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    walls_text = ", ".join(f"{s} {v['wall_s']:.0f} s" for s, v in stages.items())
    print(f"wrote {args.out}: {walls_text}")

    figures_dir = RESULTS / "pipeline-h200"
    figures_dir.mkdir(exist_ok=True)
    for stage, names in REPORTS.items():
        if stage not in manifests:
            continue
        for name in names:
            src = manifests[stage].parent / name
            if src.exists():
                shutil.copyfile(src, figures_dir / f"{stage}-{name}")


if __name__ == "__main__":
    main()
