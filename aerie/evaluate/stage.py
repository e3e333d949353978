"""The evaluate stage in the pipeline (`aerie.stage` contract): the drafter's acceptance beside prompt
lookup's. The work itself is `aerie.evaluate.work`, imported when it runs (torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aerie.errors import ConfigError
from aerie.families import family_of
from aerie.manifest import StageResult
from aerie.stage import Stage, StageJob

if TYPE_CHECKING:
    from aerie.config import PipelineConfig
    from aerie.evaluate.config import EvaluateConfig, PromptFormat
    from aerie.targets import TargetInfo


def evaluate_config(cfg: PipelineConfig) -> EvaluateConfig:
    """`cfg.evaluate` measuring the drafter this run trains: its family's proposer where the default
    family is listed (a default-family run's config, and key, stay as they are), with prompts rendered
    and completions read as the corpus did (its template, template variables and reasoning parser)."""
    ev = cfg.evaluate.model_copy(update={"prompt_format": corpus_format(cfg)})
    return ev.measuring(cfg.train.drafter.family)


def corpus_format(cfg: PipelineConfig) -> PromptFormat:
    """The corpus's prompt format; `evaluate.prompt_format` set otherwise in a pipeline is refused (it
    would measure prompts rendered unlike the training data)."""
    from aerie.evaluate.config import PromptFormat

    c = cfg.corpus
    fmt = PromptFormat(
        chat_template=c.chat_template,
        chat_template_kwargs=c.chat_template_kwargs,
        reasoning_parser=c.reasoning_parser,
    )
    if cfg.evaluate.prompt_format not in (PromptFormat(), fmt):
        raise ConfigError(
            "evaluate.prompt_format differs from the corpus's (corpus.chat_template, chat_template_kwargs, "
            "reasoning_parser): in a pipeline the evaluation renders prompts as the corpus did; set those"
        )
    return fmt


class EvaluateStage(Stage):
    name = "evaluate"

    def enabled(self, cfg: PipelineConfig) -> bool:
        return cfg.evaluate.enabled

    def resolve(self, cfg: PipelineConfig, target: TargetInfo) -> PipelineConfig:
        return cfg.model_copy(update={"evaluate": evaluate_config(cfg)})

    def key(self, job: StageJob) -> str:
        from aerie.evaluate.work import key_of

        return key_of(job.cfg.evaluate, job.ctx.target, job.upstream.drafter, job.upstream.corpus)

    def run(self, job: StageJob) -> list[StageResult]:
        from aerie.evaluate.work import run
        from aerie.trackers import Tracking

        return [
            run(
                job.cfg.evaluate,
                job.work(),
                drafter=job.upstream.drafter,
                corpus=job.upstream.corpus,
                family=family_of(job.cfg.train.drafter),
                tracking=Tracking.of(job.cfg),
            )
        ]


EVALUATE = EvaluateStage()
