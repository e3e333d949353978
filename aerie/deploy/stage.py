"""The deploy stage in the pipeline (`aerie.stage` contract): the drafter served with speculative
decoding against the baseline, promoted if it pays. The work itself is `aerie.deploy.work`, imported
when it runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aerie.manifest import StageResult
from aerie.stage import Stage, StageContext, Upstream

if TYPE_CHECKING:
    from aerie.config import PipelineConfig


class DeployStage(Stage):
    name = "deploy"

    def enabled(self, cfg: PipelineConfig) -> bool:
        return cfg.deploy.enabled

    def key(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> str:
        from aerie.deploy.work import key_of

        return key_of(cfg.deploy, cfg.server, ctx.target, upstream.drafter, upstream.evaluation)

    def run(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> list[StageResult]:
        from aerie.deploy.work import deploy
        from aerie.trackers import Tracking

        out = self.stage_dir(cfg, ctx, upstream)
        work = ctx.work(out)
        return [
            deploy(
                cfg.deploy,
                work,
                drafter=upstream.drafter,
                evaluation=upstream.evaluation,
                server=cfg.server,
                tracking=Tracking.of(cfg),
            )
        ]


DEPLOY = DeployStage()
