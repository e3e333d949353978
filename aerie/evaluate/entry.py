"""The evaluate stage in the pipeline (`aerie.stage` contract): the drafter's acceptance beside prompt
lookup's. The work itself is `aerie.evaluate.stage`, imported when it runs (torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aerie.manifest import StageResult
from aerie.stage import Stage, StageContext, Upstream

if TYPE_CHECKING:
    from aerie.config import PipelineConfig


class EvaluateStage(Stage):
    name = "evaluate"

    def enabled(self, cfg: PipelineConfig) -> bool:
        return cfg.evaluate.enabled

    def key(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> str:
        from aerie.evaluate.stage import key_of

        return key_of(cfg.evaluate, ctx.target, upstream.drafter, upstream.corpus)

    def run(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> list[StageResult]:
        from aerie.evaluate.stage import run

        return [run(cfg.evaluate, drafter=upstream.drafter, corpus=upstream.corpus, **ctx.args(self.name))]


EVALUATE = EvaluateStage()
