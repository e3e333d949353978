"""The GPU host's environment: `aerie.bundle`'s install and environment with the working tree on the path
(every job brings the tree, so aerie is not installed there), and the import check of what was shipped."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aerie.bundle.install import NO_BYTECODE, environ, export_lines
from aerie.bundle.install import install as install_wheels
from aerie.bundle.install import verify_install as verify_bundle
from aerie.bundle.layout import InstallDir as Home
from aerie.bundle.wheels import wheel_key

REPO = Path(__file__).resolve().parents[2]
DEFAULT_HOME = "/tmp/aerie-host"  # outside the working tree, which every job gets anew
# module -> distribution: imported by `install` when that distribution was shipped, plus aerie's own.
IMPORT_CHECK = {
    "pydantic": "pydantic",
    "pydantic_settings": "pydantic-settings",
    "dotenv": "python-dotenv",
    "polars": "polars",
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "gguf": "gguf",
    "boto3": "boto3",
    "prefect": "prefect",
}
AERIE_IMPORT_CHECK = ("aerie.config", "aerie.pipeline", "aerie.engine.server.app")

__all__ = ["NO_BYTECODE", "export_lines"]


def gpuhost_command(*args: str) -> list[str]:
    """`python -m tools.gpuhost ARGS` with this interpreter: how `run` starts its children."""
    return [sys.executable, "-m", "tools.gpuhost", *args]


def host_environ(
    home: Home, cache_dir: Path | None = None, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment aerie runs in on the host: `aerie.bundle`'s, with the working tree after the
    shipped wheels and the stand-in data packages."""
    return environ(home, cache_dir, base, extra_paths=[REPO])


def install(home: Home) -> bool:
    """The shipped wheels into HOME/site (idempotent); True when it installed."""
    return install_wheels(home)


def verify_install(home: Home, extra_modules: Sequence[str] = ()) -> None:
    """Import the shipped modules and aerie's pipeline in the host environment; raises BundleError."""
    shipped = {wheel_key(p.name)[0] for p in (home.staged / "wheels").glob("*.whl")}
    modules = [m for m, dist in IMPORT_CHECK.items() if dist in shipped]
    print(verify_bundle(home, [*modules, *AERIE_IMPORT_CHECK, *extra_modules], extra_paths=[REPO]))


def run_child(
    home: Home, args: list[str], cache_dir: Path | None = None, **kw: Any
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        gpuhost_command(*args),
        env=host_environ(home, cache_dir),
        cwd=REPO,
        text=True,
        **kw,
    )
