"""The merge stage in the pipeline (`aerie.stage` contract): the generated conversations in, the
tokenized, split corpus out. The work itself is `aerie.corpus.work`, imported when it runs (Polars)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aerie.manifest import StageResult
from aerie.stage import Stage, StageContext, Upstream

if TYPE_CHECKING:
    from aerie.config import PipelineConfig


class MergeStage(Stage):
    name = "merge"

    def key(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> str:
        from aerie.corpus.work import key_of

        return key_of(cfg.corpus, ctx.target, upstream.generated)

    def run(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> list[StageResult]:
        from aerie.corpus.work import run

        out = self.stage_dir(cfg, ctx, upstream)
        return [run(cfg.corpus, ctx.work(out), inputs=upstream.generated)]


MERGE = MergeStage()
