"""The `sglang` tests' common parts: SGLang's own environment (`make setup-sglang`), the CPU shims on the
SGLang server's PYTHONPATH, the record of calls into them, and a CPU server config for real SGLang.

A test that needs SGLang calls `sglang_python()`: it skips, naming the setup command, only where the
environment is not built (`make pytest` builds it first) or SGLANG_TESTS=0 opts out.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aerie.serving import ServerConfig
from aerie.serving.spec import SGLANG_SETUP, SGLANG_VENV

REPO = Path(__file__).resolve().parent.parent
VERSION = (REPO / "envs" / "sglang" / "VERSION").read_text().strip()
SHIMS = REPO / "tests" / "sglang_cpu_shims"
# Each call into a shim appends "<pid> <name>" to this file (tests/sglang_cpu_shims/_shim.py).
SHIM_CALLS_ENV = "AERIE_SHIM_CALLS_FILE"
OPT_OUT_ENV = "SGLANG_TESTS"
# A small Llama-family target SGLang's CPU engine serves (the embedded default's target).
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def sglang_python() -> str:
    """SGLang's environment's interpreter, or a skip saying how to get it."""
    if os.environ.get(OPT_OUT_ENV) == "0":
        pytest.skip(f"{OPT_OUT_ENV}=0: the SGLang tests are switched off")
    python = SGLANG_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no SGLang environment at {SGLANG_VENV}: run `{SGLANG_SETUP}`")
    return str(python)


def shim_env(calls_file: Path) -> dict[str, str]:
    """The SGLang server's environment on this CPU: the shims importable, their calls recorded."""
    calls_file.parent.mkdir(parents=True, exist_ok=True)
    calls_file.touch()
    return {"PYTHONPATH": str(SHIMS), SHIM_CALLS_ENV: str(calls_file)}


def shim_calls(calls_file: Path) -> list[str]:
    """Every recorded call into a shim ("<pid> <name>"), in order."""
    return calls_file.read_text().splitlines() if calls_file.exists() else []


def cpu_config(port: int, calls_file: Path, **fields: object) -> ServerConfig:
    """Real SGLang on this CPU through the process launcher, its shim calls recorded to `calls_file`."""
    values: dict[str, object] = {
        "backend": "sglang",
        "device": "cpu",
        "python": sglang_python(),
        "port": port,
        "env": shim_env(calls_file),
        "grace_s": 20.0,
    }
    return ServerConfig.model_validate({**values, **fields})
