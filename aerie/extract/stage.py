"""The extraction stage in the pipeline (`aerie.stage` contract): the corpus through the target's
server into hidden-state shards. The work itself is `aerie.extract.work` (one host) or
`aerie.extract.slices` (a slice per host), imported when it runs (torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aerie.manifest import StageResult
from aerie.stage import Stage, StageContext, Upstream

if TYPE_CHECKING:
    from aerie.config import PipelineConfig
    from aerie.extract.config import ExtractConfig
    from aerie.targets import TargetInfo


def extract_config(cfg: PipelineConfig, target: TargetInfo) -> ExtractConfig:
    """`cfg.extract` with the layers to capture filled in from `train.drafter`'s family (unless set):
    the shards hold what the drafter reads. Where those are extraction's own default (EAGLE-3's three,
    `TargetInfo.aux_layers_output`) it stays None, so the key is unchanged."""
    ex = cfg.extract
    layers = cfg.train.capture_layers(target.num_layers)
    if ex.capture_layers is not None or layers == target.aux_layers_output:
        return ex
    return ex.model_copy(update={"capture_layers": layers})


class ExtractStage(Stage):
    name = "extract"

    def resolve(self, cfg: PipelineConfig, target: TargetInfo) -> PipelineConfig:
        return cfg.model_copy(update={"extract": extract_config(cfg, target)})

    def enabled(self, cfg: PipelineConfig) -> bool:
        """An online training (`train.source: online`) runs its own servers: no shards to make."""
        return cfg.train.source != "online"

    def key(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> str:
        from aerie.extract.plan import extract_key

        return extract_key(cfg.extract, cfg.server, ctx.target, upstream.corpus)

    def needs(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> bool:
        """No manifest yet, or (with `ctx.rebuild_missing`) a manifest whose shards are not all in the
        store: a manifest travels without its shards (`tools.gpuhost` never moves hidden states)."""
        from aerie.shards.keys import missing_shards

        cached = self.cached(cfg, ctx, upstream)
        if cached is None:
            return True
        return ctx.rebuild_missing and bool(missing_shards(ctx.store, cached[0]))

    def run(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> list[StageResult]:
        from aerie.extract.work import run

        out = self.stage_dir(cfg, ctx, upstream)
        work = ctx.work(out)
        return [
            run(
                cfg.extract,
                work,
                corpus=upstream.corpus,
                server=cfg.server,
                rebuild_missing=ctx.rebuild_missing,
            )
        ]


EXTRACT = ExtractStage()
