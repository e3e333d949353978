"""The deploy stage in the pipeline (`aerie.stage` contract): the drafter served with speculative
decoding against the baseline, promoted if it pays. The work itself is `aerie.deploy.work`, imported
when it runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aerie.manifest import StageResult
from aerie.stage import Stage, StageJob

if TYPE_CHECKING:
    from aerie.config import PipelineConfig
    from aerie.plan.served import ServedEstimate


class DeployStage(Stage):
    name = "deploy"

    def enabled(self, cfg: PipelineConfig) -> bool:
        return cfg.deploy.enabled

    def key(self, job: StageJob) -> str:
        from aerie.deploy.work import key_of

        cfg, upstream = job.cfg, job.upstream
        return key_of(cfg.deploy, cfg.server, job.ctx.target, upstream.drafter, upstream.evaluation)

    def run(self, job: StageJob) -> list[StageResult]:
        from aerie.deploy.work import deploy
        from aerie.trackers import Tracking

        cfg = job.cfg
        return [
            deploy(
                cfg.deploy,
                job.work(),
                drafter=job.upstream.drafter,
                evaluation=job.upstream.evaluation,
                server=cfg.server,
                tracking=Tracking.of(cfg),
            )
        ]

    def predict(self, job: StageJob) -> ServedEstimate | None:
        """The speed-up the measured step and round times predict at the evaluated acceptance length,
        logged before serving (`aerie.plan.served`). The prediction is SGLang's on a GPU: a deployment
        served on the CPU gets none."""
        from aerie.plan import served

        if job.cfg.server.device == "cpu":
            return None
        return served.before_deploy(job.cfg.deploy, job.ctx.target, job.upstream.evaluation)

    def with_prediction(self, prediction: Any, results: list[StageResult]) -> list[StageResult]:
        """The prediction beside the measured speed-up (`predicted_speedup_c<level>`)."""
        from aerie.plan import served

        return served.after_deploy(prediction, results)


DEPLOY = DeployStage()
