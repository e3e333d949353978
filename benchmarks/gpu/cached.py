"""Which stages of a preset a run in HOME would take as finished, before any GPU time is spent on it.

    python benchmarks/gpu/cached.py --home HOME [--preset smollm2-gpu] [--expect train] [k=v ...]

A host restored from pack-outs resumes only where every stage's key matches what was packed: a key
that differs (another tokenizer conversion, another config) would quietly redo the stage and every
stage after it. This prints each stage's key and whether its manifest is there, and exits 1 when a stage
up to `--expect` would run again. It reads the store only (the target is resolved, nothing is started):
the composer's own loop, each step a cache lookup.
"""

from __future__ import annotations

import argparse
import sys

from aerie.manifest import StageResult
from aerie.pipeline import compose, planned, resolve
from aerie.plan import track
from aerie.presets import load_config
from aerie.stage import StageContext, StageJob
from aerie.store import open_store
from aerie.targets import resolve_target


class _ToRun(Exception):
    """The first stage a run would do again: the dry run stops there."""

    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self.stage = stage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--home", required=True, help="the GPU host's home (its store is HOME/store)")
    parser.add_argument("--preset", default="smollm2-gpu")
    parser.add_argument("--expect", help="the last stage that must be finished already")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_config(args.preset, [*args.overrides, f"store.uri={args.home}/store"])
    ctx = StageContext(store=open_store(cfg.store), run=cfg.run, target=resolve_target(cfg.target))
    cfg = resolve(cfg, ctx.target, track.plan_for(cfg))  # as the run itself does

    def finished(job: StageJob) -> list[StageResult]:
        """The composer's step, dry: a stage's finished result, or stop at the first it would run."""
        stage = job.stage
        result = stage.cached(job)
        state = "finished" if result else "to run"
        print(f"cached: {stage.name:<9} {job.key()}  {state}", flush=True)
        if result is None:
            raise _ToRun(stage.name)
        return result

    names = [s.name for s in planned(cfg)]
    try:
        compose(cfg, ctx, finished)
        redo: list[str] = []
    except _ToRun as stop:
        redo = names[names.index(stop.stage) :]
    expected = [s.name for s in planned(cfg, args.expect)] if args.expect else []
    again = [s for s in expected if s in redo]
    if again:
        print(f"cached: {', '.join(again)} would run again", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
