"""The `sglang` tests' common parts: SGLang's own environment (`make setup-sglang`), the CPU shims on the
SGLang server's PYTHONPATH, the record of calls into them, and a CPU server config for real SGLang.

A test that needs SGLang calls `sglang_python()`: it skips, naming the setup command, only where the
environment is not built (`make pytest` builds it first) or SGLANG_TESTS=0 opts out.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aerie.serving import ServerConfig, ServerSpec
from aerie.serving.spec import SGLANG_SETUP, SGLANG_VENV
from aerie.sglang_plugin.launch import MODULE as PLUGIN_LAUNCHER
from aerie.sglang_plugin.launch import rewrite_args

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


def script_env(calls_file: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a script run by SGLang's interpreter (not a server): this process's, `extra`
    (a launch's own environment: SGLANG_USE_CPU_ENGINE), the shims importable and their calls recorded."""
    return {**os.environ, **(extra or {}), **shim_env(calls_file), "HF_HUB_OFFLINE": "1"}


SERVE_MODULE = "sglang.launch_server"


def sglang_argv(spec: ServerSpec) -> list[str]:
    """The arguments `sglang.launch_server` receives from one of aerie's launches: the dump plugin's
    launcher rewrites an extraction's (it adds and forces flags, and takes --dump-dir for itself)."""
    assert spec.module in (PLUGIN_LAUNCHER, SERVE_MODULE), spec.describe()
    if spec.module == PLUGIN_LAUNCHER:
        return rewrite_args(spec.command, spec.env).argv
    assert spec.command[1:3] == ["-m", SERVE_MODULE], spec.describe()
    return spec.command[3:]
