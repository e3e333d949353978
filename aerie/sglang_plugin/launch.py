"""Container entrypoint: `python3 -m aerie.sglang_plugin.launch <sglang server args> [--dump-dir DIR]`.

1. refuse an SGLang version the plugin was not written for (`compat.py`);
2. rewrite the arguments for prefill-only extraction: token ids in (`--skip-tokenizer-init`), whole
   samples per forward (`--chunked-prefill-size -1`: a chunked sample keeps only its last chunk),
   no prefix reuse (`--disable-radix-cache`: a reused prefix is not recomputed, so its states would
   be missing), an eager prefill (`--disable-prefill-cuda-graph`: the dump hook must run in Python),
   and a launch nonce (`--weight-version run-<nonce>`) the readiness probe reads back;
   refuse what would split the hidden states across ranks or load a draft;
3. register `capture.install` with SGLang's plugin loader through a generated `*.dist-info` on
   PYTHONPATH (so SGLang's spawned schedulers load it), then exec `sglang.launch_server`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aerie.errors import ServerLaunchError
from aerie.sglang_plugin.capture import DUMP_DIR_ENV
from aerie.sglang_plugin.compat import check_sglang_version, installed_sglang_version
from aerie.version import __version__

MODULE = "aerie.sglang_plugin.launch"
PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_NAME = "aerie_dump"
PLUGIN_TARGET = "aerie.sglang_plugin.capture:install"
DIST_NAME = "aerie_sglang_dump"

# Flags added when missing (booleans).
REQUIRED_SWITCHES = ("--skip-tokenizer-init", "--disable-radix-cache", "--disable-prefill-cuda-graph")
# Flags whose value is forced.
FORCED_VALUES = {"--chunked-prefill-size": "-1"}
# Flags refused, with the reason.
REFUSED = {
    "--speculative-algorithm": "extraction runs the target alone; a draft would change the forward",
    "--enable-dp-attention": "DP attention splits tokens across ranks; the dump hook sees only rank 0's",
    "--enable-return-aux-hidden-states": "the aerie plugin does its own aux capture; do not combine",
}
# Flags whose value must be 1 (pipeline parallelism puts the captured layers on other ranks).
MUST_BE_ONE = ("--pp-size", "--pipeline-parallel-size")


@dataclass
class LaunchPlan:
    argv: list[str]
    dump_dir: Path
    notes: list[str] = field(default_factory=list)


def _split(argv: Sequence[str]) -> list[tuple[str, str | None]]:
    """Tokens as (flag, value) pairs: `--a=1` and `--a 1` alike; a bare switch has value None."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("--") and "=" in tok:
            flag, value = tok.split("=", 1)
            out.append((flag, value))
        elif tok.startswith("--") and i + 1 < len(argv) and not _is_flag(argv[i + 1]):
            out.append((tok, argv[i + 1]))
            i += 1
        else:
            out.append((tok, None))
        i += 1
    return out


def _is_flag(tok: str) -> bool:
    # "-1" is a value (chunked prefill size), "--x" and "-x" are flags.
    return tok.startswith("-") and not tok.lstrip("-").replace(".", "", 1).isdigit()


def strip_self(argv: Sequence[str]) -> list[str]:
    """Drop a leading `<python> -m aerie.sglang_plugin.launch`: the image's ENTRYPOINT already is that
    command, and a launcher that passes the full command line (aerie's docker launcher does) would
    otherwise hand it to SGLang as arguments."""
    args = list(argv)
    if len(args) >= 3 and args[1] == "-m" and args[2] == MODULE:
        return args[3:]
    if args and not args[0].startswith("-"):
        raise ServerLaunchError(
            f"unexpected argument {args[0]!r}: pass SGLang server flags (--model-path ...), optionally "
            f"after `python3 -m {MODULE}`"
        )
    return args


def rewrite_args(argv: Sequence[str], environ: Mapping[str, str]) -> LaunchPlan:
    """The SGLang argv for extraction, and the dump dir (from `--dump-dir` or AERIE_DUMP_DIR)."""
    pairs = _split(strip_self(argv))
    out: list[tuple[str, str | None]] = []
    notes: list[str] = []
    dump_dir = environ.get(DUMP_DIR_ENV)
    seen: set[str] = set()
    for flag, value in pairs:
        if flag == "--dump-dir":
            if value is None:
                raise ServerLaunchError("--dump-dir needs a directory")
            dump_dir = value
            continue
        if flag in REFUSED:
            raise ServerLaunchError(f"{flag} cannot be used for extraction: {REFUSED[flag]}")
        if flag in MUST_BE_ONE and value not in (None, "1"):
            raise ServerLaunchError(
                f"{flag} {value}: pipeline parallelism is not supported for extraction "
                "(the captured layers would live on other ranks); use --tp-size"
            )
        if flag in FORCED_VALUES and value != FORCED_VALUES[flag]:
            notes.append(f"{flag} {value} replaced by {FORCED_VALUES[flag]} (whole samples per forward)")
            value = FORCED_VALUES[flag]
        seen.add(flag)
        out.append((flag, value))
    if "--model-path" not in seen and "--model" not in seen:
        raise ServerLaunchError("no --model-path: the launcher needs the target model")
    version = dict(out).get("--weight-version")
    if not version or not version.startswith("run-"):
        raise ServerLaunchError(
            "no --weight-version run-<nonce>: the readiness probe proves the server is this launch by "
            "reading the nonce back from /server_info"
        )
    for switch in REQUIRED_SWITCHES:
        if switch not in seen:
            out.append((switch, None))
            notes.append(f"added {switch}")
    for flag, value in FORCED_VALUES.items():
        if flag not in seen:
            out.append((flag, value))
            notes.append(f"added {flag} {value}")
    if not dump_dir:
        raise ServerLaunchError(f"no dump dir: pass --dump-dir DIR or set {DUMP_DIR_ENV}")
    flat: list[str] = []
    for flag, value in out:
        flat.append(flag)
        if value is not None:
            flat.append(value)
    return LaunchPlan(argv=flat, dump_dir=Path(dump_dir), notes=notes)


def register_plugin(site_dir: Path) -> Path:
    """Write a minimal `*.dist-info` declaring the entry point; importlib.metadata finds it on any
    sys.path entry, so putting `site_dir` on PYTHONPATH registers the plugin in every child process."""
    info = site_dir / f"{DIST_NAME}-{__version__}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: {__version__}\n")
    (info / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\n{PLUGIN_NAME} = {PLUGIN_TARGET}\n")
    return site_dir


def child_env(environ: Mapping[str, str], site_dir: Path, dump_dir: Path) -> dict[str, str]:
    """The environment SGLang runs with: the plugin and aerie importable, the dump dir set, and the
    plugin allowed through SGLANG_PLUGINS when that whitelist is in use."""
    env = dict(environ)
    aerie_root = str(Path(__file__).resolve().parents[2])  # the folder holding the aerie package
    paths = [str(site_dir), aerie_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env[DUMP_DIR_ENV] = str(dump_dir)
    allowed = env.get("SGLANG_PLUGINS")
    if allowed and PLUGIN_NAME not in {x.strip() for x in allowed.split(",")}:
        env["SGLANG_PLUGINS"] = f"{allowed},{PLUGIN_NAME}"
    return env


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        version = check_sglang_version(installed_sglang_version())
        plan = rewrite_args(argv, os.environ)
        plan.dump_dir.mkdir(parents=True, exist_ok=True)
    except (ServerLaunchError, OSError) as exc:
        print(f"aerie extraction launcher: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    site_dir = register_plugin(Path(tempfile.mkdtemp(prefix="aerie-sglang-plugin-")))
    env = child_env(os.environ, site_dir, plan.dump_dir)
    for note in plan.notes:
        print(f"aerie extraction launcher: {note}", flush=True)
    print(
        f"aerie extraction launcher: sglang {version}, dumps to {plan.dump_dir}, plugin {PLUGIN_TARGET}",
        flush=True,
    )
    cmd = [sys.executable, "-m", "sglang.launch_server", *plan.argv]
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
