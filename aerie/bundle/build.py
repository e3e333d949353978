"""`aerie bundle`: here, with network, everything an offline host needs to run aerie, written as part
folders of a chosen size: the wheels, aerie's own wheel, the preset's target and (`--with-data`) its data,
and the installer `install.pyz` in every part."""

from __future__ import annotations

import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aerie.bundle.data import (
    SHAREGPT_EXPORT,
    SHAREGPT_STANDIN,
    SHAREGPT_XZ,
    sharegpt_export,
    standin_init,
    standin_package,
)
from aerie.bundle.files import MIB, size_text
from aerie.bundle.parts import BundledFile, plan_parts, write_parts
from aerie.bundle.wheels import aerie_roots, aerie_wheel, download_wheels, markers, wheel_pins
from aerie.errors import ConfigError

INSTALLER = "install.pyz"
# What contents.json (the index: a line per file) may take in each part beside the pieces.
INDEX_ROOM = 64 * 1024


@dataclass
class BundleRequest:
    """What `aerie bundle` puts in a bundle (each field is its command-line option)."""

    out: Path
    preset: str = "smollm2-local"
    overrides: list[str] = field(default_factory=list)
    max_part_mb: float | None = None  # None: one part
    python_version: str = ""  # the host's Python (major.minor); "": this interpreter's
    platforms: list[str] = field(default_factory=list)  # the host's platform tags; []: this machine's
    extras: list[str] = field(default_factory=list)  # aerie's extras to carry too
    only: list[str] = field(default_factory=list)  # these distributions instead of aerie's requirements
    skip: list[str] = field(default_factory=list)  # distributions the host has (not carried)
    always: list[str] = field(default_factory=list)  # carried even when skipped
    find_links: list[str] = field(default_factory=list)
    no_index: bool = False
    wheels: bool = True  # aerie's requirements
    aerie: bool = True  # aerie's own wheel
    aerie_from: Path | None = None
    wheels_from: list[Path] = field(default_factory=list)
    target: bool = True
    data: bool = False
    full_text: bool = False
    installer: bool = True
    prefix: str = "part"
    work: Path | None = None  # downloads and exports, reused by a re-run (default OUT/.work)


def this_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _wheel_files(req: BundleRequest, work: Path) -> tuple[list[BundledFile], dict[str, str]]:
    files: list[BundledFile] = []
    pins: dict[str, str] = {}
    if req.wheels:
        env = markers(req.python_version or this_python(), req.platforms[0] if req.platforms else "")
        roots = req.only or aerie_roots(req.extras, env)
        pins = wheel_pins(roots, env, frozenset(req.skip), frozenset(req.always))
        print(
            f"wheels to carry ({len(pins)}): " + ", ".join(f"{n}=={v}" for n, v in pins.items()), flush=True
        )
        wheels = download_wheels(
            pins, work / "wheels", req.python_version, req.platforms, req.find_links, req.no_index
        )
        files += [BundledFile(f"wheels/{w.name}", w) for w in wheels]
    if req.aerie:
        built = aerie_wheel(work / "aerie-wheel", req.aerie_from)
        files.append(BundledFile(f"wheels/{built.name}", built))
    for extra_dir in req.wheels_from:
        files += [BundledFile(f"wheels/{w.name}", w) for w in sorted(Path(extra_dir).glob("*.whl"))]
    return files, pins


def _data_files(cfg: Any, req: BundleRequest, work: Path) -> tuple[list[BundledFile], dict[str, Any] | None]:
    from aerie.datasets import MTBENCH_PACKAGE, MTBENCH_QUESTIONS, SHAREGPT_PACKAGE

    for dataset in cfg.generate.datasets:
        if dataset.source.kind not in ("sharegpt", "mtbench") or dataset.source.path is not None:
            raise ConfigError(
                f"dataset {dataset.name!r} reads {dataset.source.kind} from {dataset.source.path}: a bundle "
                "carries the data packages (sharegpt, mtbench) only; copy other files to the host yourself"
            )
    files: list[BundledFile] = []
    export = sharegpt_export(cfg, (work / SHAREGPT_XZ).parent, full_text=req.full_text)
    if export is not None:
        files += [
            BundledFile(SHAREGPT_XZ, work / SHAREGPT_XZ, expand_to=SHAREGPT_STANDIN),
            BundledFile(SHAREGPT_EXPORT, work / SHAREGPT_EXPORT),
            standin_init(work / "standins", SHAREGPT_PACKAGE, SHAREGPT_STANDIN.split("/", 2)[2]),
        ]
    files += standin_package(work / "standins", MTBENCH_PACKAGE, MTBENCH_QUESTIONS)
    return files, export


def _target_files(cfg: Any, work: Path) -> list[BundledFile]:
    """The embedded target as its data package, or an HF target as the Hugging Face cache holds it (found
    there offline through HF_HUB_CACHE, which the installed environment points at `staged/hf/hub`)."""
    from aerie.targets import EMBEDDED

    name = cfg.target.name
    if name in EMBEDDED:
        package, filename = EMBEDDED[name]
        return standin_package(work / "standins", package, filename)
    if Path(name).expanduser().is_dir():
        print(f"target {name!r} is a local folder: copy it to the host and name it there", flush=True)
        return []
    from huggingface_hub import snapshot_download

    snapshot = Path(snapshot_download(name, revision=cfg.target.revision))
    repo = f"hf/hub/models--{name.replace('/', '--')}"
    ref = work / "hf-refs" / repo / "refs" / (cfg.target.revision or "main")
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(snapshot.name)
    files = [BundledFile(f"{repo}/refs/{ref.name}", ref)]
    for path in sorted(p for p in snapshot.rglob("*") if p.is_file()):
        rel = path.relative_to(snapshot).as_posix()
        files.append(BundledFile(f"{repo}/snapshots/{snapshot.name}/{rel}", path.resolve()))
    return files


def write_installer(path: Path) -> Path:
    """`install.pyz`: aerie's bundle code with the standard library alone (what runs before any wheel is
    installed), run as `python3 PART/install.pyz --into DEST` on the offline host."""
    import aerie

    package = Path(aerie.__file__).parent
    path.parent.mkdir(parents=True, exist_ok=True)
    main = (
        "import sys\nfrom pathlib import Path\nfrom aerie.bundle.cli import main\n"
        "# The bundle's folder (the one holding the part folders) is unpacked first.\n"
        "bundle = Path(sys.argv[0]).resolve().parent.parent\n"
        "sys.exit(main(['install', str(bundle), *sys.argv[1:]]))\n"
    )
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as pyz:
        pyz.writestr("__main__.py", main)
        for name in ("__init__.py", "version.py", "errors.py"):
            pyz.write(package / name, f"aerie/{name}")
        for module in sorted((package / "bundle").glob("*.py")):
            pyz.write(module, f"aerie/bundle/{module.name}")
    return path


def build_bundle(req: BundleRequest) -> dict[str, Any]:
    """Write the bundle into `req.out` (its part folders, and `.work/`, the downloads a re-run reuses)."""
    from aerie.presets import load_config

    out = req.out
    work = req.work or out / ".work"
    work.mkdir(parents=True, exist_ok=True)
    cfg = load_config(req.preset, req.overrides)
    files, pins = _wheel_files(req, work)
    export = None
    if req.data:
        data, export = _data_files(cfg, req, work)
        files += data
    if req.target:
        files += _target_files(cfg, work)
    for f in files:
        f.measure()
    extras = [write_installer(work / INSTALLER)] if req.installer else []
    capacity = _capacity(req, extras)
    index = plan_parts(files, capacity, req.prefix)
    index.update(
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        preset=req.preset,
        overrides=req.overrides,
        target=cfg.target.name,
        python_version=req.python_version or this_python(),
        wheels=pins,
        sharegpt=export,
    )
    sizes = write_parts(files, index, out, extras)
    print(f"bundled {len(files)} files ({size_text(sum(f.size for f in files))}) as bundle {index['id']}:")
    for name, size in sizes:
        large = [
            p["file"] for e in index["files"] for p in e["parts"] if p["bundle"] == name and p["size"] > MIB
        ]
        small = sum(1 for e in index["files"] for p in e["parts"] if p["bundle"] == name and p["size"] <= MIB)
        print(f"  {out / name}: {size_text(size)} — {', '.join(large) or '-'} (+{small} small files)")
    return index


def _capacity(req: BundleRequest, extras: list[Path]) -> int:
    """The bytes of files each part may take: the part size less the index and the installer."""
    if req.max_part_mb is None:
        return 1 << 62
    limit = int(req.max_part_mb * MIB)
    reserve = sum(p.stat().st_size for p in extras) + min(INDEX_ROOM, limit // 4)
    if reserve >= limit:
        raise ConfigError(
            f"--max-part-mb {req.max_part_mb}: each part also carries the index and the installer "
            f"({size_text(reserve)}); give at least {reserve / MIB * 2:.2f}"
        )
    return limit - reserve
