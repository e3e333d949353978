"""One torchrun worker: `python -m torch.distributed.run --nproc-per-node N -m aerie.train.worker SPEC.json`.

Every rank trains; rank 0 also writes the trainer's records, one JSON line each, to `events.jsonl` in
the work dir, which the stage process tails (metrics, progress, checkpoint uploads).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from aerie.train.distributed import init_distributed, shutdown_distributed
from aerie.train.loop import TrainSpec, run_training
from aerie.train.work import EVENTS


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m aerie.train.worker SPEC.json", file=sys.stderr)
        return 2
    spec = TrainSpec.model_validate_json(Path(argv[0]).read_text())
    dist = init_distributed(spec.device)
    try:
        if dist.is_main:
            with open(Path(spec.work_dir) / EVENTS, "a") as events:

                def emit(record: dict[str, Any]) -> None:
                    events.write(json.dumps(record) + "\n")
                    events.flush()

                run_training(spec, dist, emit)
        else:
            run_training(spec, dist, lambda record: None)
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
