"""The bundle's two command lines: `aerie bundle` here (the parser `add_bundle_parser` adds to aerie's),
and `python -m aerie.bundle install|unpack|env|check` (or `python3 PART/install.pyz`) on the offline host.
Exit codes there: 0 done, 1 error, 3 parts still missing (`unpack --require-complete`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aerie.bundle.install import (
    IMPORT_CHECK,
    check_environment,
    export_lines,
    install,
    verify_install,
    write_env_script,
)
from aerie.bundle.layout import InstallDir
from aerie.bundle.parts import CONTENTS
from aerie.bundle.unpack import UnpackReport, unpack
from aerie.errors import AerieError, SourceNotFoundError

# ---- here: `aerie bundle`


def add_bundle_parser(sub: Any) -> None:
    """`aerie bundle` in aerie's command line (`sub`: its subparsers)."""
    p = sub.add_parser(
        "bundle",
        help="pack aerie, its wheels, a target and data for a host without network (docs/air-gapped.md)",
    )
    p.add_argument("--out", required=True, help="the bundle's folder (its part folders are written there)")
    p.add_argument("--preset", default="smollm2-local", help="the preset (or YAML) whose target and data go")
    p.add_argument("overrides", nargs="*", help="key=value overrides for that preset")
    p.add_argument("--max-part-mb", type=float, help="MiB per part folder (default: one part)")
    p.add_argument("--with-data", dest="data", action="store_true", help="also carry the preset's datasets")
    p.add_argument("--full-text", action="store_true", help="keep assistant turns of regenerated datasets")
    p.add_argument("--no-target", dest="target", action="store_false", help="do not carry the target")
    p.add_argument("--python-version", default="", help="the host's Python, e.g. 3.12 (default: this one)")
    p.add_argument("--platform", dest="platforms", action="append", default=[],
                   help="the host's platform tag, e.g. manylinux_2_28_x86_64 (default: this machine's)")  # fmt: skip
    p.add_argument("--extra", dest="extras", action="append", default=[], help="an aerie extra to carry too")
    p.add_argument("--only", nargs="+", default=[],
                   help="carry these distributions (and what they require) instead of aerie's requirements")  # fmt: skip
    p.add_argument("--skip", nargs="+", default=[], help="distributions the host already has (not carried)")
    p.add_argument("--skip-from", help="a file of distributions the host has (`pip freeze` there)")
    p.add_argument("--find-links", action="append", default=[], help="a folder of wheels pip looks in first")
    p.add_argument("--no-index", action="store_true", help="take wheels from --find-links only")
    p.add_argument("--no-wheels", dest="wheels", action="store_false", help="carry no requirement wheels")
    p.add_argument("--aerie-from", type=Path, help="aerie's wheel, or a checkout to build it from")
    p.add_argument("--wheels-from", type=Path, action="append", default=[], help="also carry *.whl here")
    p.set_defaults(func=_cmd_bundle)


def skip_list(path: str | None) -> list[str]:
    """Distribution names of a `pip freeze` / `pip list --format=freeze` file (comments and options out)."""
    if path is None:
        return []
    import re

    names = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.append(re.split(r"[\s=<>!~@\[;]", line, maxsplit=1)[0])
    return names


def _cmd_bundle(args: argparse.Namespace) -> int:
    from aerie.bundle.build import BundleRequest, build_bundle

    fields = {k: v for k, v in vars(args).items() if k in BundleRequest.__dataclass_fields__}
    fields.update(out=Path(args.out), skip=[*args.skip, *skip_list(args.skip_from)])
    build_bundle(BundleRequest(**fields))
    print(f"on the host: python3 {args.out}/part-1/install.pyz --into DEST  (docs/air-gapped.md)")
    return 0


# ---- on the offline host: `python -m aerie.bundle ...`


def part_folders(source: Path) -> list[Path]:
    """`source` when it is a part folder, else the part folders in it."""
    if (source / CONTENTS).is_file():
        return [source]
    parts = sorted(p.parent for p in source.glob(f"*/{CONTENTS}"))
    if not parts:
        raise SourceNotFoundError(f"{source} holds no part of a bundle (no {CONTENTS} in it or below it)")
    return parts


def print_report(part: Path, report: UnpackReport) -> None:
    print(f"unpack {part}: {len(report.placed)} pieces placed, {len(report.assembled)} files reassembled")
    for line in report.corrupt:
        print(f"unpack: CORRUPT {line}")
    if report.missing:
        print(f"unpack: still missing {len(report.missing)} piece(s):")
        for line in report.missing:
            print(f"  {line}")
    else:
        print("unpack: every file of the bundle is in place")


def _cmd_unpack(args: argparse.Namespace) -> int:
    report = unpack(Path(args.part), InstallDir(Path(args.into)))
    print_report(Path(args.part), report)
    if report.corrupt:
        return 1
    return 3 if report.missing and args.require_complete else 0


def _cmd_install(args: argparse.Namespace) -> int:
    dest = InstallDir(Path(args.into))
    for source in args.sources:
        for part in part_folders(Path(source)):
            report = unpack(part, dest)
            if report.corrupt:
                print_report(part, report)
                return 1
    install(dest)
    script = write_env_script(dest)
    if not args.no_check:
        print(verify_install(dest, args.check or IMPORT_CHECK))
    print(f"installed in {dest.root}: `. {script}`, then `aerie run PRESET --no-prefect`")
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    print("\n".join(export_lines(InstallDir(Path(args.dest)))))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    import importlib.metadata as md

    problems = check_environment(Path(args.site), args.modules)
    names = sorted(f"{d.metadata['Name']} {d.version}" for d in md.distributions(path=[args.site]))
    print(f"installed and importable: {', '.join(names) or 'none'}")
    for p in problems:
        print(f"check: {p}")
    return 1 if problems else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m aerie.bundle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "install", help="unpack the parts, install the wheels into DEST/site, check, write env.sh"
    )
    p.add_argument("sources", nargs="*", help="part folders, or folders holding them (none: DEST's)")
    p.add_argument("--into", required=True, help="the folder aerie is installed into")
    p.add_argument(
        "--check", nargs="+", help=f"modules to import as the check (default {' '.join(IMPORT_CHECK)})"
    )
    p.add_argument("--no-check", action="store_true", help="skip the import check")
    p.set_defaults(func=_cmd_install)
    p = sub.add_parser("unpack", help="one part folder into DEST (parts may come one at a time)")
    p.add_argument("part")
    p.add_argument("--into", required=True)
    p.add_argument("--require-complete", action="store_true", help="exit 3 while pieces are missing")
    p.set_defaults(func=_cmd_unpack)
    p = sub.add_parser("env", help="print the export lines of the installed environment")
    p.add_argument("dest")
    p.set_defaults(func=_cmd_env)
    p = sub.add_parser("check", help="(internal) the installed environment's check, run in it")
    p.add_argument("--site", required=True)
    p.add_argument("modules", nargs="*")
    p.set_defaults(func=_cmd_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except AerieError as exc:
        print(f"aerie: error: {exc}", file=sys.stderr)
        return 1
