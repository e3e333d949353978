"""The `aerie` command: the library's commands (`aerie.cli`), with `aerie run PRESET` through the
Prefect flow (`--no-prefect` or `--until` run the stages in this process, as the library does)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from aerie import cli
from aerie.config import PipelineConfig

# Prefect waits 20 s for its ephemeral API server by default; the first start on a machine also creates
# its database, which took longer than that on a busy 2-core machine and failed the run before any stage.
EPHEMERAL_START_S = "90"


def run_flow(cfg: PipelineConfig) -> str:
    """The pipeline flow, locally (an ephemeral Prefect API unless PREFECT_API_URL is set)."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", EPHEMERAL_START_S)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # offline: no telemetry to send
    from .pipeline import run_pipeline  # Prefect is imported only when a run is asked for

    return run_pipeline(cfg)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(argv, run_flow=run_flow)


if __name__ == "__main__":
    sys.exit(main())
