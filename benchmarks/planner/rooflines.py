"""Each measured throughput beside its roofline, written into the record that holds it.

A rate alone cannot be judged: 308K tokens/s of extraction is fast or slow only against what the GPU and
the disk could do. For each throughput figure of the whole-run and SGLang records this works out the
work of a token (a prefill or decode token: 2 x the target's active parameters plus attention, as
`aerie plan` counts it; a trained position: the drafter's forward and backward at the run's settings),
the share of the GPU's datasheet peak FLOP/s that rate uses, and for extraction the share of the host
disk's measured write rate its shards take, into a record of its own beside the records it reads.

    python benchmarks/planner/rooflines.py          # writes benchmarks/results/rooflines-h200.json
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from aerie.plan.facts import hardware, target_facts  # noqa: E402
from aerie.plan.throughput import Model, draft_flops, prefill_flops_per_token  # noqa: E402
from aerie.presets import load_config  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DISK = ("disk_write-h200.json", "figures.methods.buffered.mean_mb_per_s")  # MB/s, 1 GiB buffered writes
# record -> (preset and overrides of the run, hardware, [(what, key of the rate, kind, key of bytes/token)])
FIGURES: dict[str, tuple[list[str], str, list[tuple[str, str, str, str | None]]]] = {
    "h200-pipeline.json": (
        ["smollm2-gpu", "train.drafter.draft_vocab_size=32768", "train.epochs=6"],
        "h200",
        [
            (
                "extract stage",
                "stages.extract.figures.tokens_per_s",
                "prefill",
                "stages.extract.figures.bytes_per_token",
            ),
            (
                "extract, steady",
                "stages.extract.figures.steady_tokens_per_s",
                "prefill",
                "stages.extract.figures.bytes_per_token",
            ),
            (
                "generation, completion tokens",
                "stages.generate-sharegpt.figures.tokens_per_s",
                "decode",
                None,
            ),
            (
                "training",
                "stages.train.figures.train_tokens / stages.train.figures.train_wall_s",
                "train",
                None,
            ),
        ],
    ),
    "sglang-h200.json": (
        ["smollm2-gpu"],
        "h200",
        [("extract stage, SGLang", "extract.tokens_per_s", "prefill", None)],
    ),
}


def at(record: dict[str, Any], path: str) -> float:
    """The value at a dotted path, or the quotient of two (`a / b`)."""
    if " / " in path:
        top, bottom = path.split(" / ")
        return at(record, top) / at(record, bottom)
    node: Any = record
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return float(node)


def work_per_token(overrides: list[str], hw_name: str, kind: str) -> float:
    cfg = load_config(overrides[0], overrides[1:])
    target = target_facts(cfg.target)
    if kind == "prefill":
        return prefill_flops_per_token(target, cfg.corpus.max_length)
    if kind == "decode":  # a decode token at a mean context of a quarter of the cap
        return prefill_flops_per_token(target, cfg.corpus.max_length // 2)
    return draft_flops(Model(cfg, target, hardware(hw_name)), cfg.train.max_length // 2)


def rooflines(
    record: dict[str, Any], overrides: list[str], hw_name: str, figures: list[Any]
) -> dict[str, Any]:
    hw = hardware(hw_name)
    disk_record = json.loads((RESULTS / DISK[0]).read_text())
    disk = at(disk_record, DISK[1]) * 1e6
    out: dict[str, Any] = {
        "preset": " ".join(overrides),
        "peak_flops": hw.peak_flops,
        "peak": f"one {hw.description}: {hw.peak_flops / 1e12:.1f} TFLOP/s dense bf16 (aerie/plan/data/hardware.json)",
        "disk_bytes_per_s": disk,
        "disk": f"{DISK[0]} {DISK[1]}: measured on another host of the same kind than the run's, so a share "
        "above 1 says the run's disk wrote faster than that one's mean",
        "work": "prefill: 2 x active parameters + attention over half the corpus cap; decode: the same over a "
        "quarter of it; training: the drafter's forward and backward per position (aerie/plan/throughput.py)",
        "figures": {},
    }
    for what, key, kind, bytes_key in figures:
        rate = at(record, key)
        flops = work_per_token(overrides, hw_name, kind)
        entry: dict[str, Any] = {
            "what": what,
            "rate_per_s": round(rate, 1),
            "flop_per_token": round(flops),
            "share_of_peak_flops": round(rate * flops / hw.peak_flops, 4),
        }
        if bytes_key:
            written = rate * at(record, bytes_key)
            entry["write_bytes_per_s"] = round(written)
            entry["share_of_disk"] = round(written / disk, 3)
        out["figures"][key] = entry
    return out


def main() -> None:
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    out: dict[str, Any] = {
        "code_paths": [
            "benchmarks/planner/rooflines.py",
            "aerie/plan/throughput.py",
            "aerie/plan/data/hardware.json",
        ],
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": "none: worked out from the records it names",
        "command": "python benchmarks/planner/rooflines.py",
        "computed_at_commit": head,
        "records": {},
    }
    for name, (overrides, hw_name, figures) in FIGURES.items():
        record = json.loads((RESULTS / name).read_text())
        out["records"][name] = rooflines(record, overrides, hw_name, figures)
        for key, entry in out["records"][name]["figures"].items():
            print(f"{name} {key}: {entry['share_of_peak_flops']:.1%} of peak", entry.get("share_of_disk", ""))
    (RESULTS / "rooflines-h200.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
