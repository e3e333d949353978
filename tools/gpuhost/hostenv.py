"""The host's environment: the staged wheels installed into HOME/site, the environment aerie runs in
there, and its check in a child process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aerie.errors import HostSetupError
from tools.gpuhost.files import read_json, write_json
from tools.gpuhost.home import Home
from tools.gpuhost.unpack import require_unpacked
from tools.gpuhost.wheels import wheel_key

REPO = Path(__file__).resolve().parents[2]
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


def gpuhost_command(*args: str) -> list[str]:
    """`python -m tools.gpuhost ARGS` with this interpreter: how `run` and `install` start their children."""
    return [sys.executable, "-m", "tools.gpuhost", *args]


def shipped_site() -> str:
    """HOME/site in a child of `run`/`install`: first on the PYTHONPATH that host_environ() sets."""
    return os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]


NO_BYTECODE = "PYTHONDONTWRITEBYTECODE"  # forbids writing byte code: unset in the host environment


def host_environ(
    home: Home, cache_dir: Path | None = None, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment aerie runs in on the host: shipped wheels first on the path, then the stand-in
    data packages, then the repository; caches in the home; no network lookups."""
    env = dict(os.environ if base is None else base)
    paths = [str(home.site), str(home.staged / "pkgs"), str(REPO)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        AERIE_CACHE_DIR=str(cache_dir or home.root / "cache"),
        AERIE_GPUHOST_HOME=str(home.root),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    # Keep the byte code Python compiles: host images that set PYTHONDONTWRITEBYTECODE and ship torch
    # without .pyc files make every process compile torch again (16-17 s to load a tokenizer cold).
    env.pop(NO_BYTECODE, None)
    return env


def install(home: Home) -> bool:
    """`pip install --no-index --no-deps --target HOME/site` of every staged wheel, into a fresh
    directory swapped in whole; skipped when that exact set is installed. True when it installed."""
    require_unpacked(home, "wheels/", "install")
    wanted = {e["path"]: e["sha256"] for e in home.index()["files"] if e["path"].startswith("wheels/")}
    marker = home.site / ".aerie-installed.json"
    if marker.is_file() and read_json(marker, "the install record") == wanted:
        print(f"{len(wanted)} wheels already installed in {home.site}")
        return False
    wheels = [home.staged / p for p in sorted(wanted)]
    tmp = home.root / "site.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if wheels:
        cmd = [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
            "--no-cache-dir", "--disable-pip-version-check", "--target", str(tmp), *map(str, wheels),
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise HostSetupError(
                f"pip install of the staged wheels in {home.staged / 'wheels'} failed:\n{done.stderr.strip()[-3000:]}"
            )
    tmp.mkdir(exist_ok=True)
    write_json(tmp / marker.name, wanted)
    shutil.rmtree(home.site, ignore_errors=True)
    os.replace(tmp, home.site)
    print(f"installed {len(wheels)} wheels into {home.site}")
    return True


def check_environment(modules: Sequence[str]) -> list[str]:
    """Run in the host environment: every shipped distribution's requirements met (versions checked
    with `packaging`, which the host has), every module importable. Returns the problems."""
    import importlib
    import importlib.metadata as md

    from packaging.requirements import Requirement

    problems = []
    for dist in md.distributions(path=[shipped_site()]):
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                problems.append(f"{dist.metadata['Name']} needs {req}, which is not installed")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{dist.metadata['Name']} needs {req}, the host has {req.name} {have}")
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            problems.append(f"import {module}: {exc.__class__.__name__}: {exc}")
    return problems


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


def verify_install(home: Home, extra_modules: Sequence[str] = ()) -> None:
    """Check the installed wheels in a child with the host environment (requirements met, the shipped
    modules and aerie's pipeline importable); raises on any problem."""
    shipped = {wheel_key(p.name)[0] for p in (home.staged / "wheels").glob("*.whl")}
    modules = [m for m, dist in IMPORT_CHECK.items() if dist in shipped]
    done = run_child(home, ["check", *modules, *AERIE_IMPORT_CHECK, *extra_modules], capture_output=True)
    if done.returncode != 0:
        raise HostSetupError(
            f"the environment installed in {home.site} is not usable:\n{(done.stdout + done.stderr).strip()}"
        )
    print(done.stdout.strip())
