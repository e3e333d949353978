"""The generation stage in the pipeline (`aerie.stage` contract): every dataset of `generate.datasets`,
one result each, with the embedded endpoint (the configured server serving the target) launched only
when some dataset still has to be generated. The work itself is `aerie.generate.work`, imported when
it runs (httpx, Polars)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from aerie.manifest import StageResult, stage_key
from aerie.stage import Stage, StageContext, Upstream
from aerie.store import ArtifactStore
from aerie.targets import TargetInfo

if TYPE_CHECKING:
    from aerie.config import PipelineConfig
    from aerie.generate.config import GenerateConfig
    from aerie.serving import ServerSpec


def generate_config(cfg: PipelineConfig) -> GenerateConfig:
    """`cfg.generate` as the stage runs it: a dataset's `max_context_tokens` left at None takes the
    corpus's max_length (what the corpus keeps of a conversation is all that is worth generating)."""
    datasets = [
        spec
        if spec.max_context_tokens is not None
        else spec.model_copy(update={"max_context_tokens": cfg.corpus.max_length})
        for spec in cfg.generate.datasets
    ]
    return cfg.generate.model_copy(update={"datasets": datasets})


def generation_spec(cfg: PipelineConfig, target: TargetInfo) -> ServerSpec:
    """The launch of the embedded generation server: the configured backend (the reference server or
    SGLang, whose /v1/chat/completions both answer) serving the target, with generation's own flags."""
    from aerie.serving import spec_for

    return spec_for(
        cfg.server,
        model_path=target.path,
        mode="serve",
        name=f"{cfg.server.backend}-generate",
        extra_args=reasoning_args(cfg, target) + list(cfg.generate.endpoint.launch_args),
        trust_remote_code=target.trust_remote_code,
    )


def reasoning_args(cfg: PipelineConfig, target: TargetInfo) -> list[str]:
    """SGLang's `--reasoning-parser` for a thinking target, so answers come back with their reasoning
    in `reasoning_content` (the corpus parses by the same name); none when the launch names one."""
    from pathlib import Path

    from aerie.reasoning import parser_for

    given = cfg.generate.endpoint.launch_args + cfg.server.extra_args
    if cfg.server.backend != "sglang" or any(a.split("=", 1)[0] == "--reasoning-parser" for a in given):
        return []
    override = cfg.corpus.chat_template
    template = (
        Path(override).expanduser().read_text() if override else target.load_tokenizer().get_chat_template()
    )
    parser = parser_for(target.architecture, str(template), cfg.corpus.reasoning_parser)
    return ["--reasoning-parser", parser.name] if parser is not None else []


@contextlib.contextmanager
def generation_endpoint(cfg: PipelineConfig, target: TargetInfo) -> Iterator[str]:
    """The endpoint generation talks to: the configured one, or the configured server serving the
    target itself for the duration of generation (the embedded default)."""
    if cfg.generate.endpoint.base_url:
        yield cfg.generate.endpoint.base_url
        return
    from aerie.serving import ModelServer

    with ModelServer(generation_spec(cfg, target)) as server:
        yield f"{server.url}/v1"


def generation_pending(cfg: PipelineConfig, store: ArtifactStore) -> bool:
    """True when some dataset still needs the target (so an embedded endpoint must be launched, and a
    remote one needs its key)."""
    from aerie.generate.work import key_of, stage_name
    from aerie.manifest import StageDir

    gen = generate_config(cfg)
    return any(
        spec.regenerate and StageDir(store, cfg.run, stage_name(spec), key_of(gen, spec)).manifest() is None
        for spec in gen.datasets
    )


class GenerateStage(Stage):
    name = "generate"

    def key(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> str:
        """The datasets' own keys together (each dataset's result lives under its own key)."""
        from aerie.generate.work import key_of

        gen = generate_config(cfg)
        return stage_key(self.name, [key_of(gen, spec) for spec in gen.datasets])

    def cached(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> list[StageResult] | None:
        from aerie.generate.work import key_of, stage_name
        from aerie.manifest import StageDir

        gen = generate_config(cfg)
        found = [
            StageDir(ctx.store, ctx.run, stage_name(spec), key_of(gen, spec)).cached_result()
            for spec in gen.datasets
        ]
        return None if any(r is None for r in found) else [r for r in found if r is not None]

    def needs(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> bool:
        """Work for the target: a dataset taken as it is (`regenerate: false`) costs no endpoint."""
        return generation_pending(cfg, ctx.store)

    def run(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> list[StageResult]:
        from aerie.generate.work import run_all

        return run_all(
            generate_config(cfg),
            store=ctx.store,
            run_name=ctx.run,
            endpoint=lambda: generation_endpoint(cfg, ctx.target),
            progress=ctx.progress,
        )


GENERATE = GenerateStage()
