"""The merge stage in the pipeline (`aerie.stage` contract): the generated conversations in, the
tokenized, split corpus out. The work itself is `aerie.corpus.work`, imported when it runs (Polars)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aerie.manifest import StageResult
from aerie.stage import Stage, StageJob

if TYPE_CHECKING:
    pass


class MergeStage(Stage):
    name = "merge"

    def key(self, job: StageJob) -> str:
        from aerie.corpus.work import key_of

        return key_of(job.cfg.corpus, job.ctx.target, job.upstream.generated)

    def run(self, job: StageJob) -> list[StageResult]:
        from aerie.corpus.work import run

        return [run(job.cfg.corpus, job.work(), inputs=job.upstream.generated)]


MERGE = MergeStage()
