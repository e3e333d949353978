"""`stage` (here, with network): `aerie bundle` with the GPU hosts' settings. The host image holds
torch and the rest, so only the roots in `wheels.py` travel; the working tree travels with every job,
so aerie's own wheel and the installer do not; the bundle folders keep their names (`bundle-K`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from aerie.bundle.build import BundleRequest, build_bundle
from tools.gpuhost.wheels import ALWAYS_SHIP, BASE_ROOTS, EXTRAS, HOST_PACKAGES, PLATFORMS


def stage(args: argparse.Namespace) -> int:
    out = Path(args.out)
    build_bundle(
        BundleRequest(
            out=out,
            preset=args.preset,
            overrides=args.overrides,
            max_part_mb=args.max_bundle_mb,
            python_version=args.python_version,
            platforms=PLATFORMS,
            only=[*BASE_ROOTS, *(r for extra in args.extras for r in EXTRAS[extra])],
            skip=sorted(HOST_PACKAGES),
            always=sorted(ALWAYS_SHIP),
            wheels=args.wheels,
            aerie=False,
            wheels_from=[Path(d) for d in args.wheels_from],
            target=args.target,
            data=True,
            full_text=args.full_text,
            installer=False,
            prefix="bundle",
            work=out,
        )
    )
    return 0
