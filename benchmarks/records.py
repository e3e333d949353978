"""What every benchmark's record shares: where records go, the hardware part of their names, and the header
each one opens with (date, machine, command, commit, the code it measures). Standard library only: the
GPU jobs import it under interpreters that carry no more than SGLang's packages.

A script (run as `python benchmarks/<kind>/<script>.py` from the repository's root) writes
`results/<benchmark>-<hardware>.json`:

    record = {**header(["benchmarks/stages/store.py", "aerie/store.py"]), "figures": figures}
    write(RESULTS / f"store-{hardware_name('cpu')}.json", record)
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def hardware_name(device: str) -> str:
    """The hardware part of a record's name: `cpu`, or the GPU's model in lower case (`NVIDIA H200` ->
    `h200`)."""
    if device == "cpu":
        return "cpu"
    import torch

    index = int(device.split(":", 1)[1]) if ":" in device else 0
    model = torch.cuda.get_device_name(index).lower()
    return model.removeprefix("nvidia ").split()[0].replace("-", "")


def now() -> str:
    """The record's date: UTC, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def machine(*more: str) -> str:
    """`x86_64 2 CPUs, Python 3.11.7`, then what the script adds (its device, the load at the start)."""
    return ", ".join(
        [f"{platform.machine()} {os.cpu_count()} CPUs", f"Python {platform.python_version()}", *more]
    )


def command(argv: list[str] | None = None) -> str:
    """How the script ran, as a reader re-runs it from the repository's root:
    `python benchmarks/stages/store.py --size-mb 256`."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    shown = script.relative_to(ROOT).as_posix() if script.is_relative_to(ROOT) else argv[0]
    return shlex.join(["python", shown, *argv[1:]])


def commit(code_paths: list[str]) -> str | None:
    """The commit whose code the record measures, or None where git cannot say or the working tree
    changes `code_paths`: the commit that adds the record then stands for it (scripts/check_figures.py)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", *code_paths],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return None if changed else head


def header(code_paths: list[str], machine_said: str | dict[str, Any] | None = None) -> dict[str, Any]:
    """The keys a record opens with. `code_paths`: the code it measures (a quote of the record is stale
    once git shows a later commit to them); `machine_said`: the machine as the script describes it, where
    `machine()` says too little."""
    out: dict[str, Any] = {
        "date": now(),
        "machine": machine() if machine_said is None else machine_said,
        "command": command(),
    }
    if (measured := commit(code_paths)) is not None:
        out["commit"] = measured
    out["code_paths"] = code_paths
    return out


def write(path: Path, record: dict[str, Any]) -> None:
    """The record as indented JSON (its folder made), and printed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, indent=2) + "\n"
    path.write_text(text)
    print(text, end="")
