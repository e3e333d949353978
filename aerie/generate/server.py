"""The embedded generation server's launch: the configured backend (the reference server or SGLang)
serving the target for as long as generation runs, with generation's own flags (its chat template and
reasoning parser)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from aerie.errors import ConfigError
from aerie.targets import TargetInfo

if TYPE_CHECKING:
    from aerie.config import PipelineConfig
    from aerie.serving import ServerSpec


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
    """The generation server's `--chat-template` (corpus.chat_template: generation renders prompts with
    the template the corpus renders with) and `--reasoning-parser` for a thinking target, so answers
    come back with their reasoning in `reasoning_content` (the corpus parses by the same name). SGLang
    and the reference server take both flags; each is left out when the launch names it."""
    from pathlib import Path

    from aerie.reasoning import parser_for, read_template

    given = {a.split("=", 1)[0] for a in cfg.generate.endpoint.launch_args + cfg.server.extra_args}
    override = cfg.corpus.chat_template
    out: list[str] = []
    if override and "--chat-template" not in given:
        if cfg.server.launcher == "docker":
            raise ConfigError(
                "corpus.chat_template with server.launcher=docker: the generation server in its container "
                "cannot read the file; pass it in server.extra_args as --chat-template <path in the "
                "container> (a mounted directory, e.g. the target's)"
            )
        out += ["--chat-template", str(Path(override).expanduser().resolve())]
    if "--reasoning-parser" not in given:
        template = read_template(override) if override else target.load_tokenizer().get_chat_template()
        parser = parser_for(target.geometry.architecture, str(template), cfg.corpus.reasoning_parser)
        out += ["--reasoning-parser", parser.name] if parser is not None else []
    return out


@contextlib.contextmanager
def generation_endpoint(cfg: PipelineConfig, target: TargetInfo) -> Iterator[str]:
    """The endpoint generation talks to: the configured one, or the configured server serving the
    target itself for the duration of generation (the embedded default), relaunched on its port when
    it dies (`aerie.generate.relaunch`)."""
    if cfg.generate.endpoint.base_url:
        yield cfg.generate.endpoint.base_url
        return
    from aerie.generate.relaunch import launched

    with launched(generation_spec(cfg, target), cfg.generate.max_server_restarts) as url:
        yield url
