"""The tiny pipeline configuration shared by tests/test_pipeline.py and scripts/screenshots.py:
smollm2-local shrunk to seconds per stage, every stage still running for real. Import-side-effect free."""

from __future__ import annotations

from pathlib import Path


def tiny_overrides(store: Path, *, run: str, port: int) -> list[str]:
    return [
        f"store.uri={store}",
        f"run={run}",
        f"server.port={port}",
        "generate.datasets.0.num_samples=6",
        "generate.datasets.0.sampling.max_tokens=16",
        "corpus.max_length=96",
        "corpus.eval_fraction=0.34",
        "train.epochs=2",
        "train.eval_every=2",
        "train.batch_tokens=256",  # rows are padded to it: 2048 made 2 steps cost ~12 s of attention on pads
        "evaluate.num_steps=[3]",
        "evaluate.max_new_tokens=8",
        "evaluate.mtbench_questions=2",
        "evaluate.heldout_samples=1",
        "deploy.concurrency=[1]",
        "deploy.num_prompts=2",
        "deploy.max_new_tokens=8",
        # One short steady-state window: the pipeline tests check that deploy runs, not its figures.
        "deploy.level_seconds=0.2",
        "deploy.requests_per_slot=1",
        "deploy.repeats=1",
    ]
