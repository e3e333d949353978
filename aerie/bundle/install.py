"""The offline side after unpacking: the bundle's wheels installed into `site/`, the environment aerie
runs in there (written to `env.sh`), and its check in a child process. Standard library only (and pip,
which installs the wheels): it runs before any wheel is installed."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aerie.bundle.files import read_json, write_json
from aerie.bundle.layout import InstallDir
from aerie.bundle.unpack import require_unpacked
from aerie.errors import BundleError

# What `install` imports as its check unless told otherwise: the config, the stages, the model server.
IMPORT_CHECK = ("aerie.config", "aerie.pipeline", "aerie.engine.server.app")
NO_BYTECODE = "PYTHONDONTWRITEBYTECODE"  # forbids keeping compiled byte code: unset in the environment


def environ(
    dest: InstallDir,
    cache_dir: Path | None = None,
    base: dict[str, str] | None = None,
    extra_paths: Sequence[Path] = (),
) -> dict[str, str]:
    """The environment aerie runs in on the offline host: the installed wheels first on the path, then
    the data packages' stand-ins and `extra_paths`; their scripts (`aerie`) on PATH; caches in the folder;
    no network lookups by the Hugging Face libraries."""
    env = dict(os.environ if base is None else base)
    paths = [str(dest.site), str(dest.staged / "pkgs"), *map(str, extra_paths)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    hub = dest.staged / "hf" / "hub"
    if hub.is_dir():  # the bundle carries the target as the Hugging Face cache holds it
        env["HF_HUB_CACHE"] = str(hub)
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        PATH=os.pathsep.join([str(dest.site / "bin"), *([env["PATH"]] if env.get("PATH") else [])]),
        AERIE_CACHE_DIR=str(cache_dir or dest.root / "cache"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    # Keep the byte code Python compiles: images that set PYTHONDONTWRITEBYTECODE and ship torch without
    # .pyc files make every process compile torch again (seconds for each process that loads it).
    env.pop(NO_BYTECODE, None)
    return env


def export_lines(
    dest: InstallDir, cache_dir: Path | None = None, extra_paths: Sequence[Path] = ()
) -> list[str]:
    """Shell lines that give a shell `environ()`, keeping its own PYTHONPATH and PATH after ours."""
    env = environ(dest, cache_dir, base={}, extra_paths=extra_paths)
    lines = []
    for key, value in env.items():
        suffix = {"PYTHONPATH": "${PYTHONPATH:+:$PYTHONPATH}", "PATH": ":$PATH"}.get(key, "")
        lines.append(f"export {key}={shlex.quote(value)}{suffix}")
    return [*lines, f"unset {NO_BYTECODE}"]


def install(dest: InstallDir) -> bool:
    """`pip install --no-index --no-deps --target site/` of every wheel of the bundle, into a fresh folder
    swapped in whole (an interrupted install leaves the last one); skipped when that exact set is
    installed. Writes `env.sh`. True when it installed."""
    require_unpacked(dest, "wheels/", "install")
    wanted = {e["path"]: e["sha256"] for e in dest.index()["files"] if e["path"].startswith("wheels/")}
    marker = dest.site / ".aerie-installed.json"
    if marker.is_file() and read_json(marker, "the install record") == wanted:
        print(f"{len(wanted)} wheels already installed in {dest.site}")
        return False
    wheels = [dest.staged / p for p in sorted(wanted)]
    tmp = dest.root / "site.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if wheels:
        cmd = [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
            "--no-cache-dir", "--disable-pip-version-check", "--target", str(tmp), *map(str, wheels),
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise BundleError(
                f"pip install of the bundle's wheels in {dest.staged / 'wheels'} failed:\n"
                f"{done.stderr.strip()[-3000:]}"
            )
    tmp.mkdir(exist_ok=True)
    write_json(tmp / marker.name, wanted)
    shutil.rmtree(dest.site, ignore_errors=True)
    os.replace(tmp, dest.site)
    print(f"installed {len(wheels)} wheels into {dest.site}")
    return True


def write_env_script(dest: InstallDir, extra_paths: Sequence[Path] = ()) -> Path:
    """`env.sh`: `. DEST/env.sh` gives a shell the environment aerie was checked in."""
    dest.env_script.write_text("\n".join(export_lines(dest, extra_paths=extra_paths)) + "\n")
    return dest.env_script


def _requirement_class() -> Any:
    """packaging's Requirement: the host's own, else the copy pip carries (a bare Python has pip only)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[assignment]
    return Requirement


def check_environment(site: Path, modules: Sequence[str]) -> list[str]:
    """Run in the installed environment: every installed distribution's requirements met (versions
    checked), every module importable. Returns the problems."""
    import importlib
    import importlib.metadata as md

    requirement = _requirement_class()
    problems = []
    for dist in md.distributions(path=[str(site)]):
        for line in dist.requires or []:
            req = requirement(line)
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


def verify_install(
    dest: InstallDir, modules: Sequence[str] = IMPORT_CHECK, extra_paths: Sequence[Path] = ()
) -> str:
    """Check the installed wheels in a child with the installed environment (requirements met, `modules`
    importable); raises on any problem, else returns the child's report."""
    cmd = [sys.executable, "-m", "aerie.bundle", "check", "--site", str(dest.site), *modules]
    # Run in the folder itself: `-m` puts the working directory first on the path, and a checkout of
    # aerie there would be imported instead of the installed one.
    dest.root.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        cmd, env=environ(dest, extra_paths=extra_paths), capture_output=True, text=True, cwd=dest.root
    )
    if done.returncode != 0:
        raise BundleError(
            f"the environment installed in {dest.site} is not usable:\n{(done.stdout + done.stderr).strip()}"
        )
    return done.stdout.strip()
