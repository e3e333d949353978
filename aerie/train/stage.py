"""The train stage in the pipeline (`aerie.stage` contract): the shards and the corpus's token counts
in, the drafter out. The work itself is `aerie.train.work`, imported when it runs (torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aerie.manifest import StageResult
from aerie.stage import Stage, StageContext, Upstream

if TYPE_CHECKING:
    from aerie.config import PipelineConfig


class TrainStage(Stage):
    name = "train"

    def key(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> str:
        from aerie.train.work import key_of

        return key_of(cfg.train, ctx.target, upstream.shards, upstream.corpus)

    def run(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> list[StageResult]:
        from aerie.train.work import run

        return [run(cfg.train, shards=upstream.shards, corpus=upstream.corpus, **ctx.args(self.name))]


TRAIN = TrainStage()
