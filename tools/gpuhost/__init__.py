"""The project's own GPU jobs on hosts with no network: `python -m tools.gpuhost ...` (a developer tool).

`aerie bundle` (the product's air-gapped install, docs/air-gapped.md) does the packing, unpacking and
installing; this tool adds what the project's measurement jobs (benchmarks/gpu/job.sh) need beyond it:
the hosts' settings (their image's package list; bundles of a chosen size with the working tree on the
path instead of aerie's wheel), a run of the stages within a time budget, and what must outlive a host
packed into archive parts of a chosen size and number and restored on a fresh one. Every size and time
limit is a command-line option (defaults in `limits.py`):

    here (network)                        GPU host (no network)
    stage --out .stage  ── bundle-1..K ──> unpack BUNDLE --home H   (aerie.bundle's unpack)
                                           install --home H          (aerie.bundle's install + import check)
                                           run --home H PRESET --until STAGE [--budget-s S] --out O
    .stage/state/ <──────── O/state.* ───  pack-out: what must outlive the host (generated corpus...)
    .stage/state ───────────────────────>  restore --home H .stage/state  (a fresh host resumes)

    cli.py         the argument parser, `main`, the handlers that print
    limits.py      the defaults of every size and time limit (each one a command-line option)
    wheels.py      the hosts' image package list, the roots `stage` ships, the platforms
    staging.py     stage: `aerie bundle` with those settings
    hostenv.py     install, env: aerie.bundle's, with the working tree on the path
    hostconfig.py  config: the preset with overrides for this host, checked against the ShareGPT export
    runner.py      run, pipeline: the stages in a child within the budget (SIGTERM, SIGKILL, sweep)
    packout.py     pack-out: what outlives the host, in priority groups, as state.tgz.NNN + state.json
    restore.py     restore: pack-out archives checked and unpacked into a (fresh) home
"""

from __future__ import annotations

from tools.gpuhost.cli import build_parser, main
from tools.gpuhost.hostconfig import host_config
from tools.gpuhost.hostenv import DEFAULT_HOME, REPO, host_environ, install, verify_install
from tools.gpuhost.packout import STATE_INDEX, STATE_PART, WHOLE_STAGES, Group, collect_groups, pack_out
from tools.gpuhost.restore import restore
from tools.gpuhost.runner import EXIT_STOPPED, pipeline, run_stages
from tools.gpuhost.staging import stage

__all__ = [
    "DEFAULT_HOME",
    "EXIT_STOPPED",
    "REPO",
    "STATE_INDEX",
    "STATE_PART",
    "WHOLE_STAGES",
    "Group",
    "build_parser",
    "collect_groups",
    "host_config",
    "host_environ",
    "install",
    "main",
    "pack_out",
    "pipeline",
    "restore",
    "run_stages",
    "stage",
    "verify_install",
]
