"""`PipelineConfig`: one typed config of nested stage configs, loadable from YAML, overridable with
`key=value`, and built from presets that are code derived from a base (see `aerie.presets`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

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
            allowed = _fields_at(err["loc"][:-1])
            msg = "unknown field" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
        lines.append(f"  {loc}: {msg} [got {err.get('input')!r}]")
    return "\n".join(lines)


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the model at `loc` (a validation error's location without its last part)."""
    model: Any = PipelineConfig
    for part in loc:
        if isinstance(part, int):
            continue  # a list element: the list's item model
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = _model_of(field.annotation)
        if model is None:
            return []
    return sorted(getattr(model, "model_fields", {}))


def _model_of(annotation: Any) -> Any:
    """The pydantic model inside an annotation (`X`, `list[X]`, `X | None`), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        if (found := _model_of(arg)) is not None:
            return found
    return None


def validate(data: dict[str, Any], where: str = "config") -> PipelineConfig:
    """Build a PipelineConfig, turning pydantic's errors into a ConfigError that names each field."""
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, where)) from exc


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `value` at `dotted` in the config's data; a path through a value or past a list's end says
    which part of it is wrong and what is there instead."""
    node: Any = data
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth]) or "the config"
        last = depth == len(parts) - 1
        if isinstance(node, list):
            index = _list_index(node, part, where)
            if last:
                node[index] = value
                return
            node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
                return
            node = node.setdefault(part, {})
        else:
            raise ConfigError(f"{where} is {_kind(node)} ({node!r}), it has no field {part!r}")


def _list_index(node: list[Any], part: str, where: str) -> int:
    try:
        index = int(part)
    except ValueError:
        raise ConfigError(f"{where} is a list: {part!r} is not an index (0..{len(node) - 1})") from None
    if not -len(node) <= index < len(node):
        raise ConfigError(f"{where} has {len(node)} element(s): no element {index}")
    return index


def _kind(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    return names.get(type(value), type(value).__name__)


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
        except ConfigError as exc:
            raise ConfigError(f"override {item!r}: {exc}") from exc
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
