"""`python -m tools.gpuhost`: the argument parser, `main`, and the handlers that turn parsed arguments
into calls of the other modules and lines on stdout; exit codes: 0 done, 1 error, 3 unpack incomplete
(`--require-complete`), 75 `run` stopped at its budget."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from aerie.bundle.cli import print_report
from aerie.bundle.layout import InstallDir as Home
from aerie.bundle.unpack import unpack
from aerie.errors import AerieError
from tools.gpuhost import limits
from tools.gpuhost.hostconfig import host_config
from tools.gpuhost.hostenv import DEFAULT_HOME, REPO, export_lines, install, verify_install
from tools.gpuhost.packout import pack_limits, pack_out
from tools.gpuhost.restore import restore
from tools.gpuhost.runner import pipeline, run_stages
from tools.gpuhost.staging import stage
from tools.gpuhost.wheels import EXTRAS


def _cmd_unpack(args: argparse.Namespace) -> int:
    home = Home(Path(args.home))
    report = unpack(Path(args.bundle), home)
    print_report(Path(args.bundle), report)
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
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    print("\n".join(export_lines(home, cache_dir, extra_paths=[REPO])))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    print(host_config(Home(Path(args.home)), args.preset, args.overrides, Path(args.store)))
    return 0


def _cmd_pack_out(args: argparse.Namespace) -> int:
    home = Home(Path(args.home))
    since = home.created_path.stat().st_mtime if home.created_path.is_file() else None
    pack_out(home, Path(args.out), since=since, **pack_limits(args))
    return 0


def _cmd_restore(args: argparse.Namespace) -> int:
    restored, kept = restore(Home(Path(args.home)), [Path(a) for a in args.archives])
    print(f"restore: {restored} files restored into {args.home}, {kept} already there kept")
    return 0


def _add_pack_limits(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-out-mb", type=float, default=limits.OUT_MB, help="MiB pack-out writes in all")
    p.add_argument("--part-mb", type=float, default=limits.PART_MB, help="MiB per state.tgz.NNN file")
    p.add_argument(
        "--max-parts", type=int, default=limits.MAX_PARTS, help="state.tgz.NNN files at most (0: no limit)"
    )


def build_parser() -> argparse.ArgumentParser:
    # The description is the first paragraph of the package's docstring, as it was of the old module's.
    description = (sys.modules["tools.gpuhost"].__doc__ or "").split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="python -m tools.gpuhost", description=description)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("stage", help="here: `aerie bundle` with the GPU hosts' settings, as bundle-K folders")
    p.add_argument("--out", default=".stage", help="staging directory (git-ignored)")
    p.add_argument("--preset", default="smollm2-gpu", help="preset (or YAML) whose datasets are exported")
    p.add_argument("overrides", nargs="*", help="key=value overrides for that preset")
    p.add_argument("--python-version", default="3.12", help="the host's Python (major.minor)")
    p.add_argument(
        "--max-bundle-mb",
        type=float,
        default=limits.BUNDLE_MB,
        help="MiB per bundle directory: what one transfer to the host may take",
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
    p.add_argument(
        "--budget-s", type=float, default=limits.BUDGET_S, help="seconds this whole command may take (none)"
    )
    p.add_argument(
        "--grace-s", type=float, default=limits.GRACE_S, help="seconds between SIGTERM and SIGKILL"
    )
    p.add_argument(
        "--pack-reserve-s",
        type=float,
        default=limits.PACK_RESERVE_S,
        help="seconds of the budget kept for pack-out",
    )
    p.add_argument("--out", help="pack-out into this directory at the end")
    _add_pack_limits(p)
    p.add_argument("--store", help="the artifact store (default HOME/store)")
    p.add_argument("--cache-dir", help="AERIE_CACHE_DIR (default HOME/cache)")
    p.set_defaults(func=run_stages)

    p = sub.add_parser("pack-out", help="host: write what must outlive the host into OUT")
    p.add_argument("--home", default=DEFAULT_HOME)
    p.add_argument("--out", required=True)
    _add_pack_limits(p)
    p.set_defaults(func=_cmd_pack_out)

    p = sub.add_parser("restore", help="host: put pack-out archives back into a (fresh) home")
    p.add_argument("archives", nargs="+", help="state.json and state.tgz.NNN files, or their directory")
    p.add_argument("--home", default=DEFAULT_HOME)
    p.set_defaults(func=_cmd_restore)

    # Children of `run`, with the host environment set.
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except AerieError as exc:
        print(f"gpuhost: error: {exc}", file=sys.stderr)
        return 1
