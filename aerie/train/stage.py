"""The train stage in the pipeline (`aerie.stage` contract): the shards and the corpus's token counts
in, the drafter out. The work itself is `aerie.train.work`, imported when it runs (torch)."""

from __future__ import annotations

from typing import Any

from aerie.manifest import StageResult
from aerie.stage import Stage, StageJob


class TrainStage(Stage):
    name = "train"

    def key(self, job: StageJob) -> str:
        from aerie.train.work import key_of

        return key_of(job.cfg.train, job.ctx.target, corpus=job.upstream.corpus, **_inputs(job))

    def run(self, job: StageJob) -> list[StageResult]:
        from aerie.train.work import run

        return [run(job.cfg.train, job.work(), corpus=job.upstream.corpus, **_inputs(job))]


def _inputs(job: StageJob) -> dict[str, Any]:
    """The extract stage's shards, or (train.source online) what the train stage's own servers need."""
    cfg = job.cfg
    if cfg.train.source == "online":
        return {"shards": None, "extract": cfg.extract, "server": cfg.server}
    return {"shards": job.upstream.shards}


TRAIN = TrainStage()
