"""Running the pipeline on a GPU host with no network: `python -m tools.gpuhost ...` (a developer tool).

The host is reached through a narrow link: files go over in bundles of a given size, commands run
there one at a time, possibly within a time budget, and what must outlive the host comes back in
archive parts of a given size and number. Every one of those limits is a command-line option
(defaults in `limits.py`). So:

    here (network)                        GPU host (no network)
    stage --out .stage  ── bundle-1..K ──> unpack BUNDLE --home H   (parts reassembled, sha256 checked)
                                           install --home H          (wheels -> H/site, idempotent)
                                           run --home H PRESET --until STAGE [--budget-s S] --out O
                                             stages resume from H/store; stopped by SIGTERM at the budget
    .stage/state/ <──────── O/state.* ───  pack-out: what must outlive the host (generated corpus...)
    .stage/state ───────────────────────>  restore --home H .stage/state  (a fresh host resumes)

What the host lacks is staged here: the wheels aerie imports that the host image does not hold, and the
data packages as stand-ins on PYTHONPATH, found by the same `importlib.util.find_spec` lookups as here (so
`aerie.targets`/`aerie.datasets` and the presets need no change, and no stage key depends on the host's
paths): the embedded target's GGUF, MT-Bench's questions, and the ShareGPT conversations the preset reads,
exported through `aerie.datasets.iter_conversations` with placeholder assistant turns (they are
regenerated) and xz-compressed (5 MB instead of 125 MB).

Only `stage` and the config/pipeline/check children import aerie's dependencies; `unpack`, `install`,
`env`, `restore`, `pack-out` and the `run` supervisor use the standard library alone (psutil when
present), because they run before the wheels are installed.

    cli.py         the argument parser, `main`, the handlers that print (unpack, env, check, restore...)
    __main__.py    `python -m tools.gpuhost`
    limits.py      the defaults of every size and time limit (each one a command-line option)
    files.py       atomic JSON, JSON read with errors naming the file, sha256, sizes for people
    home.py        Home: the host-side directory (staged/, .parts/, site/, store/, index.json ...)
    wheels.py      stage: the host image's package list, the wheels to ship and their pip download
    standins.py    stage: the stand-in data packages and the ShareGPT export
    bundles.py     stage: the staged files planned into bundle-K/ directories with contents.json
    staging.py     stage: the command itself
    unpack.py      unpack: parts copied and checked, split files reassembled, .xz expanded
    hostenv.py     install, env, check: HOME/site from the wheels, the host environment, its check
    hostconfig.py  config: the preset with overrides for this host, checked against the ShareGPT export
    runner.py      run, pipeline: the stages in a child within the budget (SIGTERM, SIGKILL, sweep)
    packout.py     pack-out: what outlives the host, in priority groups, as state.tgz.NNN + state.json
    restore.py     restore: pack-out archives checked and unpacked into a (fresh) home

Everything a caller or test uses is importable from `tools.gpuhost` itself.
"""

from __future__ import annotations

from tools.gpuhost.bundles import CONTENTS, StagedFile, plan_bundles, write_bundles
from tools.gpuhost.cli import build_parser, main
from tools.gpuhost.files import FORMAT, MIB, sha256_file
from tools.gpuhost.home import DEFAULT_HOME, Home
from tools.gpuhost.hostconfig import host_config
from tools.gpuhost.hostenv import (
    AERIE_IMPORT_CHECK,
    IMPORT_CHECK,
    REPO,
    check_environment,
    host_environ,
    install,
    verify_install,
)
from tools.gpuhost.limits import MAX_PARTS, PART_BYTES
from tools.gpuhost.packout import (
    STATE_INDEX,
    STATE_PART,
    WHOLE_STAGES,
    Group,
    collect_groups,
    pack_out,
)
from tools.gpuhost.restore import restore
from tools.gpuhost.runner import EXIT_STOPPED, pipeline, run_stages
from tools.gpuhost.staging import stage
from tools.gpuhost.standins import (
    ASSISTANT_PLACEHOLDER,
    SHAREGPT_STANDIN,
    STANDIN_INIT,
    placeholder_of,
    sharegpt_export,
    standin_package,
)
from tools.gpuhost.unpack import UnpackReport, missing_files, unpack
from tools.gpuhost.wheels import (
    ALWAYS_SHIP,
    BASE_ROOTS,
    EXTRAS,
    HOST_PACKAGES,
    PLATFORMS,
    download_wheels,
    normalize,
    wheel_pins,
)

__all__ = [
    "AERIE_IMPORT_CHECK",
    "ALWAYS_SHIP",
    "ASSISTANT_PLACEHOLDER",
    "placeholder_of",
    "BASE_ROOTS",
    "CONTENTS",
    "DEFAULT_HOME",
    "EXIT_STOPPED",
    "EXTRAS",
    "FORMAT",
    "HOST_PACKAGES",
    "IMPORT_CHECK",
    "MAX_PARTS",
    "MIB",
    "PART_BYTES",
    "PLATFORMS",
    "REPO",
    "WHOLE_STAGES",
    "SHAREGPT_STANDIN",
    "STANDIN_INIT",
    "STATE_INDEX",
    "STATE_PART",
    "Group",
    "Home",
    "StagedFile",
    "UnpackReport",
    "build_parser",
    "check_environment",
    "collect_groups",
    "download_wheels",
    "host_config",
    "host_environ",
    "install",
    "main",
    "missing_files",
    "normalize",
    "pack_out",
    "pipeline",
    "plan_bundles",
    "restore",
    "run_stages",
    "sha256_file",
    "sharegpt_export",
    "stage",
    "standin_package",
    "unpack",
    "verify_install",
    "wheel_pins",
    "write_bundles",
]
