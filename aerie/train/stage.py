"""The train stage in the pipeline (`aerie.stage` contract): the shards and the corpus's token counts
in, the drafter out. The work itself is `aerie.train.work`, imported when it runs (torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aerie.manifest import StageResult
from aerie.stage import Stage, StageContext, Upstream

if TYPE_CHECKING:
    from aerie.config import PipelineConfig


class TrainStage(Stage):
    name = "train"

    def key(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> str:
        from aerie.train.work import key_of

        return key_of(cfg.train, ctx.target, corpus=upstream.corpus, **_inputs(cfg, ctx, upstream))

    def run(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> list[StageResult]:
        from aerie.train.work import run

        out = self.stage_dir(cfg, ctx, upstream)
        return [run(cfg.train, ctx.work(out), corpus=upstream.corpus, **_inputs(cfg, ctx, upstream))]


def _inputs(cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> dict[str, Any]:
    """The extract stage's shards, or (train.source online) what the train stage's own servers need."""
    if cfg.train.source == "online":
        return {"shards": None, "extract": cfg.extract, "server": cfg.server}
    return {"shards": upstream.shards}


TRAIN = TrainStage()
