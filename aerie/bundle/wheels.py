"""The wheels a bundle carries: aerie's requirements (with the extras asked for), less what the offline
host already has, pinned to the versions installed here (the versions aerie runs with here), downloaded
by pip for the host's Python and platform; and aerie's own wheel, built from its source tree."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from aerie.errors import BundleError, ConfigError


def normalize(name: str) -> str:
    """PEP 503 name: what pip and a host's package list compare."""
    return re.sub(r"[-_.]+", "-", name).lower()


def machine_of(platform: str) -> str:
    """The CPU of a platform tag (`manylinux_2_28_x86_64` -> `x86_64`; "": this machine's), for markers."""
    if not platform:
        import platform as this

        return this.machine()
    for machine in ("x86_64", "aarch64", "arm64", "ppc64le", "s390x"):
        if platform.endswith(machine):
            return machine
    raise ConfigError(f"--platform {platform}: not a Linux or macOS platform tag aerie knows the CPU of")


def markers(python_version: str, platform: str) -> dict[str, str]:
    """The environment requirement markers are evaluated in, for CPython `python_version` on `platform`
    (a platform tag; "": this machine's)."""
    linux = "linux" in platform if platform else sys.platform == "linux"
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "sys_platform": "linux" if linux else "darwin",
        "platform_system": "Linux" if linux else "Darwin",
        "platform_machine": machine_of(platform),
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "extra": "",
    }


def aerie_roots(extras: Iterable[str], env: dict[str, str]) -> list[str]:
    """aerie's own requirements, with those of `extras`, for the host's `env`."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    known = set(md.metadata("aerie").get_all("Provides-Extra") or [])
    unknown = sorted(set(extras) - known)
    if unknown:
        raise ConfigError(f"aerie has no extra {', '.join(unknown)} (its extras: {', '.join(sorted(known))})")
    roots = []
    for line in md.requires("aerie") or []:
        req = Requirement(line)
        # An extra that names aerie's other extras (`aerie[trackers]`) is not a wheel to download.
        if normalize(req.name) == "aerie":
            continue
        if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in ["", *extras]):
            roots.append(normalize(req.name))
    return roots


def wheel_pins(
    roots: Iterable[str],
    env: dict[str, str],
    skip: frozenset[str] = frozenset(),
    always: frozenset[str] = frozenset(),
) -> dict[str, str]:
    """The distributions to carry and their versions: `roots` and their requirements (markers evaluated
    in `env`, extras of requirements ignored), less `skip` (what the host has; their requirements are
    not followed) unless named in `always`, pinned to the public versions installed here (`2.13.0+cpu`
    here is `2.13.0` there: the host gets the index's build for its platform)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.version import Version

    skip, always = frozenset(map(normalize, skip)), frozenset(map(normalize, always))
    pins: dict[str, str] = {}
    todo = [normalize(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in pins or (name in skip and name not in always):
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise ConfigError(
                f"{name} is needed on the offline host but is not installed here, so its version cannot be "
                "pinned; install it in this environment first, or name it in --skip if the host has it"
            ) from None
        pins[name] = Version(dist.version).public
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(normalize(req.name))
    for name in always - pins.keys():
        with contextlib.suppress(md.PackageNotFoundError):
            pins[name] = Version(md.version(name)).public
    return dict(sorted(pins.items()))


def wheel_key(filename: str) -> tuple[str, str]:
    """(normalized name, version) of a wheel file name."""
    name, version = filename.split("-")[:2]
    return normalize(name), version


def _downloaded(dest: Path) -> dict[tuple[str, str], Path]:
    return {wheel_key(p.name): p for p in dest.glob("*.whl")}


# The manylinux tags named before PEP 600, by the glibc they stand for.
_LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def expand_platforms(platforms: Sequence[str]) -> list[str]:
    """Each `manylinux_2_N_ARCH` with every older glibc's tag it runs (pip matches tags exactly): a host
    with glibc 2.N runs wheels built for 2.5 to 2.N. Other tags stay as they are."""
    out: list[str] = []
    for tag in platforms:
        match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", tag)
        if not match:
            out.append(tag)
            continue
        newest, arch = int(match[1]), match[2]
        for minor in range(newest, 4, -1):
            out.append(f"manylinux_2_{minor}_{arch}")
            if minor in _LEGACY_MANYLINUX:
                out.append(f"{_LEGACY_MANYLINUX[minor]}_{arch}")
    return list(dict.fromkeys(out))


def target_args(python_version: str, platforms: Sequence[str]) -> list[str]:
    """pip's options for wheels of another Python or platform ([] for this interpreter's own)."""
    args = []
    if python_version:
        abi = "cp" + python_version.replace(".", "")
        args += ["--python-version", python_version, "--implementation", "cp",
                 "--abi", abi, "--abi", "abi3", "--abi", "none"]  # fmt: skip
    if platforms:
        args += [
            *(arg for p in expand_platforms(platforms) for arg in ("--platform", p)),
            "--platform",
            "any",
        ]
    return args


def download_wheels(
    pins: dict[str, str],
    dest: Path,
    python_version: str = "",
    platforms: Sequence[str] = (),
    find_links: Sequence[str] = (),
    no_index: bool = False,
) -> list[Path]:
    """One wheel per pin, for CPython `python_version` on any of `platforms` (a manylinux tag with the
    older ones it includes; neither given: for this interpreter); `find_links` folders are
    looked in first, and alone with `no_index`. Wheels already in `dest` are reused, so a failed bundle
    re-runs quickly."""
    dest.mkdir(parents=True, exist_ok=True)
    found = _downloaded(dest)
    sources = [arg for d in find_links for arg in ("--find-links", str(d))] + (
        ["--no-index"] if no_index else []
    )
    host = f"CPython {python_version or 'as here'} on {', '.join(platforms) or 'this platform'}"
    wheels = []
    for name, version in pins.items():
        if (name, version) not in found:
            cmd = [
                sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                "--disable-pip-version-check", *sources, *target_args(python_version, platforms),
                "-d", str(dest), f"{name}=={version}",
            ]  # fmt: skip
            print(f"downloading {name}=={version}", flush=True)
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise BundleError(
                    f"pip could not download {name}=={version} for {host}:\n{done.stderr.strip()[-2000:]}"
                )
            found = _downloaded(dest)
        if (name, version) not in found:
            raise BundleError(f"pip reported success but no wheel for {name}=={version} is in {dest}")
        wheels.append(found[(name, version)])
    return wheels


# What a source tree of aerie needs to build its wheel (pyproject.toml's packages and package-dir).
SOURCE_ITEMS = ("pyproject.toml", "README.md", "aerie", "flows", "deployments")


def source_tree() -> Path | None:
    """The source tree the imported aerie comes from, when it is one (a checkout, an editable install)."""
    import aerie

    root = Path(aerie.__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    return root if pyproject.is_file() and 'name = "aerie"' in pyproject.read_text() else None


def aerie_wheel(dest: Path, source: Path | None = None) -> Path:
    """aerie's own wheel in `dest`: `source` when it is a wheel, else built (offline, with the build backend
    installed here) from a copy of the source tree `source` or the one aerie is imported from."""
    dest.mkdir(parents=True, exist_ok=True)
    if source is not None and source.suffix == ".whl":
        return Path(shutil.copy2(source, dest))
    tree = source or source_tree()
    if tree is None or not (tree / "pyproject.toml").is_file():
        raise ConfigError(
            f"no aerie source tree at {tree or 'the imported aerie'}: pass --aerie-from a wheel of aerie "
            "or a checkout of it"
        )
    for old in dest.glob("aerie-*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="aerie-wheel-") as tmp:
        copy = Path(tmp) / "src"
        for item in SOURCE_ITEMS:
            if (tree / item).is_dir():
                shutil.copytree(tree / item, copy / item, ignore=shutil.ignore_patterns("__pycache__"))
            elif (tree / item).is_file():
                copy.mkdir(parents=True, exist_ok=True)
                shutil.copy2(tree / item, copy / item)
        cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
               "--no-index", "--disable-pip-version-check", "-w", str(dest), str(copy)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise BundleError(f"aerie's wheel could not be built from {tree}:\n{done.stderr.strip()[-2000:]}")
    return next(dest.glob("aerie-*.whl"))
