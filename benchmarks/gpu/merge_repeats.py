"""The pipeline's own merge stage, run again on the same generation: how much its seconds vary, and why.

    python benchmarks/gpu/merge_repeats.py --home HOME [--preset smollm2-gpu] [--runs 3] \\
        --out merge_repeats-h200.json

HOME holds a finished generation (a restored pack-out). Each run removes the merge stage's results and
runs `tools.gpuhost run PRESET --until merge` (a fresh process: the generation is a cache hit, the merge
runs), then reads the merge manifest's seconds and, from the run's log, when the stage's progress reached
tokenizing and when it wrote its first shard. Then, in fresh interpreters, the seconds that loading the
target's tokenizer takes cold (importing transformers, which imports torch): what a merge pays when it is
the first part of its process to need them, and does not pay after a generation that did.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from aerie.presets import load_config
from aerie.targets import resolve_target

PHASE = re.compile(r"^merge:.*?\[(\d+):(\d+)<.*?, (reading inputs|tokenizing|wrote train)")
COLD_LOAD = (
    "import sys, time; t = time.perf_counter(); from aerie.targets import resolve_target; "
    "resolve_target(sys.argv[1]).load_tokenizer(); print(time.perf_counter() - t)"
)


def phases(log: str) -> dict[str, int]:
    """The elapsed second each merge phase was first shown at (the progress bar's own clock)."""
    seen: dict[str, int] = {}
    for line in log.replace("\r", "\n").splitlines():
        if match := PHASE.match(line):
            seen.setdefault(match.group(3), int(match.group(1)) * 60 + int(match.group(2)))
    return seen


def one_merge(home: Path, preset: str, run: str) -> dict[str, Any]:
    shutil.rmtree(home / "store" / run / "merge", ignore_errors=True)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "tools.gpuhost", "run", preset, "--until", "merge", "--home", str(home)],
        capture_output=True,
        text=True,
        check=True,
    )
    process_s = time.perf_counter() - start
    manifest = json.loads(next((home / "store" / run / "merge").glob("*/manifest.json")).read_text())
    return {
        "merge_s": manifest["seconds"],
        "tokens": manifest["figures"]["tokens"],
        "records": manifest["figures"]["records"],
        "gpuhost_run_s": round(process_s, 1),
        "phase_started_at_s": phases(done.stdout + done.stderr),
    }


def cold_tokenizer_load_s(target: str) -> float:
    """Seconds a fresh interpreter takes to import aerie and load the target's tokenizer."""
    done = subprocess.run(
        [sys.executable, "-c", COLD_LOAD, target], capture_output=True, text=True, check=True
    )
    return round(float(done.stdout), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", type=Path, required=True)
    parser.add_argument("--preset", default="smollm2-gpu")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cfg = load_config(args.preset, [f"store.uri={args.home}/store"])
    runs = [one_merge(args.home, args.preset, cfg.run) for _ in range(args.runs)]
    resolve_target(cfg.target)  # converted already by the runs: the loads below time loading alone
    cold = [cold_tokenizer_load_s(cfg.target.name) for _ in range(3)]
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"the CPUs of an H200 host (no GPU used): {platform.node()} {platform.machine()}, Python {platform.python_version()}",
        "command": "python " + " ".join(sys.argv),
        "figures": {
            "runs": runs,
            "merge_s": [r["merge_s"] for r in runs],
            "tokenizer_load_cold_s": cold,
        },
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
