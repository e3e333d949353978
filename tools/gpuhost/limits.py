"""The defaults of every size and time limit the tool applies, in one place.

Each is a command-line option (named beside it); none is fixed in the code that applies it. The
defaults suit a link to the GPU host that moves a few files of some MiB each way per command: set them
to what yours takes, or leave a limit off where the option allows it.
"""

from __future__ import annotations

from aerie.bundle.files import MIB

# `stage --max-bundle-mb`: the size of one bundle directory (parts and contents.json).
BUNDLE_MB = 56.0
# `run/pack-out --max-out-mb`: what one pack-out writes in all.
OUT_MB = 56.0
# `run/pack-out --part-mb`: the size of each state.tgz.NNN file (a little under 16 MiB by default).
PART_MB = (16 * MIB - 64 * 1024) / MIB
# `run/pack-out --max-parts`: how many state.tgz.NNN files one pack-out may write (0: no limit).
MAX_PARTS = 7
# `run --budget-s`: seconds one `run` may take before its stages are stopped (none by default).
BUDGET_S: float | None = None
# `run --grace-s` and `--pack-reserve-s`: SIGTERM to SIGKILL, and what a budget keeps for pack-out.
GRACE_S = 20.0
PACK_RESERVE_S = 25.0
# Bytes kept of the end of each run log that pack-out takes (the end says how a run stopped).
LOG_TAIL_BYTES = 2 * MIB

PART_BYTES = int(PART_MB * MIB)
