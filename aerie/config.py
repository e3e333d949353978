"""`PipelineConfig`: one typed config of nested stage configs, loadable from YAML, overridable with
`key=value`, and built from presets that are code derived from a base (see `aerie.presets`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from aerie.configbase import StrictModel
from aerie.corpus.config import CorpusConfig
from aerie.errors import ConfigError
from aerie.evaluate.config import DeployConfig, EvaluateConfig
from aerie.extract.config import ExtractConfig, server_quantization_problem
from aerie.generate.config import GenerateConfig
from aerie.serving.config import ServerConfig
from aerie.store import StoreConfig
from aerie.targets import TargetConfig
from aerie.train.config import TrainConfig


class NotifyConfig(StrictModel):
    """Where failures are announced (the URL itself is a secret: AERIE_WEBHOOK_URL)."""

    on_failure: bool = Field(True, description="Post to the webhook when a pipeline run fails or crashes.")


class PipelineConfig(StrictModel):
    """Everything one pipeline run needs. Every stage reads only its own section."""

    preset: str = Field("custom", description="The preset this config was derived from (informational).")
    run: str = Field(
        "default", pattern=r"^[A-Za-z0-9._-]+$", description="Run name: the store prefix of all stages."
    )
    store: StoreConfig = Field(default_factory=StoreConfig)
    target: TargetConfig = Field(default_factory=TargetConfig)
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    corpus: CorpusConfig = Field(default_factory=CorpusConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    deploy: DeployConfig = Field(default_factory=DeployConfig)
    notify: NotifyConfig = Field(default_factory=NotifyConfig)

    @model_validator(mode="after")
    def _extraction_server_can_quantize(self) -> PipelineConfig:
        # At load, not when extraction starts after hours of generation.
        problem = server_quantization_problem(self.extract, self.server.backend)
        if problem:
            raise ValueError(problem)
        return self


def _format_errors(exc: ValidationError, where: str) -> str:
    lines = [f"invalid config ({where}):"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"  {loc}: {msg} [got {err.get('input')!r}]")
    return "\n".join(lines)


def validate(data: dict[str, Any], where: str = "config") -> PipelineConfig:
    """Build a PipelineConfig, turning pydantic's errors into a ConfigError that names each field."""
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, where)) from exc


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    node: Any = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        if isinstance(node, list):
            node = node[int(part)]
            continue
        node = node.setdefault(part, {})
        if not isinstance(node, dict | list):
            raise ConfigError(f"override {dotted!r}: {part!r} is a value, not a section")
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def apply_overrides(cfg: PipelineConfig, overrides: list[str]) -> PipelineConfig:
    """Apply `a.b.c=value` overrides (values parsed as YAML scalars: 2, 1e-4, true, [3,7], null)."""
    data = cfg.model_dump(mode="json")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.epochs=2)")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: cannot parse the value: {exc}") from exc
        try:
            _set_path(data, key.strip(), value)
        except (IndexError, ValueError) as exc:
            raise ConfigError(f"override {item!r}: no such list element") from exc
    return validate(data, where=f"overrides {' '.join(overrides)}")


def load_yaml(path: str | Path) -> PipelineConfig:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return validate(data, where=str(path))


def to_yaml(cfg: PipelineConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
