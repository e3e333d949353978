"""`PipelineConfig`: one typed config of nested stage configs, loadable from YAML, overridable with
`key=value`, and built from presets that are code derived from a base (see `aerie.presets`)."""

from __future__ import annotations

import re
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from aerie.configbase import StrictModel
from aerie.corpus.config import CorpusConfig
from aerie.deploy.config import DeployConfig, vllm_deploy_problem
from aerie.errors import ConfigError
from aerie.evaluate.config import EvaluateConfig
from aerie.extract.config import ExtractConfig, server_quantization_problem
from aerie.families import family_of
from aerie.generate.config import GenerateConfig
from aerie.serving.config import ALL_LAUNCHES, ServerConfig, flag_conflict, launcher_problem
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
        problem = server_quantization_problem(self.extract, self.server.backend) or launcher_problem(
            self.server
        )
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _deploy_serves_the_family(self) -> PipelineConfig:
        # At load, not after training and evaluation: the deploy stage serves only some families.
        drafter = family_of(self.train.drafter)
        if self.deploy.enabled and not drafter.deployable:
            raise ValueError(
                f"the deploy stage does not serve {drafter.name} drafters (train.drafter.family): set "
                "deploy.enabled=false (the evaluate stage measures it)"
            )
        return self

    @model_validator(mode="after")
    def _deploy_engine_runs_here(self) -> PipelineConfig:
        # At load, not after training: deploy.engine vllm names a benchmark aerie cannot run yet.
        problem = vllm_deploy_problem(self.deploy, self.server)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _tree_drafts_need_sglang(self) -> PipelineConfig:
        # The reference server decodes one chain; found at load rather than after training.
        if self.deploy.eagle_topk != 1 and self.server.backend != "sglang":
            raise ValueError(
                f"deploy.eagle_topk {self.deploy.eagle_topk} drafts trees, which only server.backend "
                f"'sglang' serves (server.backend is {self.server.backend!r}; allowed with it: eagle_topk 1)"
            )
        return self

    @model_validator(mode="after")
    def _generation_flags_fit_the_server(self) -> PipelineConfig:
        # The embedded generation server is server.backend's: SGLang would refuse the reference
        # server's --cuda-graphs (the GPU preset's) at launch, after the stages before it ran.
        if self.server.backend == "sglang" and "--cuda-graphs" in self.generate.endpoint.launch_args:
            raise ValueError(
                "generate.endpoint.launch_args gives the reference server's --cuda-graphs, but with "
                "server.backend 'sglang' the generation server is SGLang, which captures CUDA graphs by "
                "default: set generate.endpoint.launch_args=[]"
            )
        return self

    @model_validator(mode="after")
    def _no_flag_given_twice(self) -> PipelineConfig:
        # A flag aerie derives from a field, given again verbatim, would silently win (argparse keeps the
        # last); one place per setting.
        for where, args, launches in (
            ("server.extra_args", self.server.extra_args, ALL_LAUNCHES),
            ("generate.endpoint.launch_args", self.generate.endpoint.launch_args, {"generate"}),
        ):
            problem = flag_conflict(where, args, launches)
            if problem:
                raise ValueError(problem)
        return self


def _format_errors(exc: ValidationError, where: str) -> str:
    lines = [f"invalid config ({where}):"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = err["msg"]
        got = f" [got {err.get('input')!r}]"
        if err["type"] == "extra_forbidden":
            allowed = _fields_at(tuple(err["loc"][:-1]))
            msg = "unknown field" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
        elif err["type"] == "value_error":
            # A model's own check: its message names the fields; the whole section as input is noise.
            msg, got = msg.removeprefix("Value error, "), ""
        lines.append(f"  {loc}: {msg}{got}")
    return "\n".join(lines)


def validate(data: dict[str, Any], where: str = "config") -> PipelineConfig:
    """Build a PipelineConfig, turning pydantic's errors into a ConfigError that names each field."""
    try:
        cfg = PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, where)) from exc
    if not cfg.generate.datasets:
        # Found here rather than by the merge, which would report it as having nothing to read.
        raise ConfigError(
            f"invalid config ({where}):\n  generate.datasets: the list is empty: a run needs at least "
            "one dataset (regenerated by the target, or taken as it is with regenerate: false)"
        )
    return cfg


_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _kind(value: Any) -> str:
    """How a value reads in an error: 'an integer', 'a string', 'null' ..."""
    if value is None:
        return "null"
    return _KINDS.get(type(value), type(value).__name__)


def _child(node: Any, part: str, where: str) -> tuple[Any, int | str]:
    """The element `part` of a section or list, with an error naming `where` when there is none."""
    if isinstance(node, list):
        if not part.lstrip("-").isdigit():
            raise ConfigError(f"{where} is a list, {part!r} is not an index (0..{len(node) - 1})")
        index = int(part)
        if not 0 <= index < len(node):
            raise ConfigError(f"{where} has {len(node)} element(s), there is no index {index}")
        return node, index
    if isinstance(node, dict):
        return node, part
    raise ConfigError(f"{where} is {_kind(node)}, it has no field {part!r}")


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node: Any = data
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth]) or "the config"
        holder, key = _child(node, part, where)
        if depth == len(parts) - 1:
            if key == "family" and isinstance(holder, dict) and holder.get(key) != value:
                holder.clear()  # another family: its own settings start at its defaults, not the last one's
            elif _same_family(holder, key, value, parts):
                return  # train.drafter=eagle3 on an eagle3 section keeps the settings it has
            holder[key] = value
            return
        if isinstance(holder, dict) and holder.get(key) is None:
            holder[key] = {}  # a new mapping (an unset dict field); pydantic names a wrong one
        elif isinstance(holder, dict) and isinstance(holder[key], str) and _tagged(parts[: depth + 1]):
            holder[key] = {"family": holder[key]}  # a tagged section given by its tag: train.drafter=dflash
        node = holder[key]


def _same_family(holder: Any, key: int | str, value: Any, path: list[str]) -> bool:
    """Whether `value` names the family the tagged section `holder[key]` already holds."""
    if not isinstance(holder, dict) or not isinstance(value, str):
        return False
    section = holder.get(key)
    return isinstance(section, dict) and section.get("family") == value and _tagged(path)


def _tagged(path: list[str]) -> bool:
    """Whether the section at `path` is tagged by a `family` field (`train.drafter`)."""
    return "family" in (_fields_at(tuple(path)) or ())


def _fields_at(loc: tuple[int | str, ...]) -> list[str] | None:
    """The fields of the config model at `loc` (a path into PipelineConfig), or None if it is not one."""
    annotation: Any = PipelineConfig
    for part in loc:
        annotation = _unwrap(annotation)
        if isinstance(part, int):
            args = get_args(annotation)
            annotation = args[0] if args else None
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(part)
            annotation = field.annotation if field else None
        else:
            return None
    annotation = _unwrap(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    return None


def _unwrap(annotation: Any) -> Any:
    """`X | None` -> X."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) in (Union, UnionType) and len(args) == 1:
        return args[0]
    return annotation


def apply_overrides(cfg: PipelineConfig, overrides: list[str]) -> PipelineConfig:
    """Apply `a.b.c=value` overrides (values parsed as YAML scalars: 2, 1e-4, true, [3,7], null)."""
    data = cfg.model_dump(mode="json")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.epochs=2)")
        try:
            value = _octal_text(raw) or (yaml.safe_load(raw) if raw else "")
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: cannot parse the value: {exc}") from exc
        try:
            _set_path(data, key.strip(), value)
        except ConfigError as exc:
            raise ConfigError(f"override {item!r}: {exc}") from exc
    return validate(data, where=f"overrides {' '.join(overrides)}")


# YAML 1.1 reads 0640 as the octal number 416: a leading-zero number stays text, as written (a file
# mode, `store.mode`, is octal text; a number field reads "010" as 10).
_LEADING_ZERO = re.compile(r"0[0-7]+")


def _octal_text(raw: str) -> str | None:
    return raw.strip() if _LEADING_ZERO.fullmatch(raw.strip()) else None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (plain YAML keeps the last, silently), and
    keeps a leading-zero number as written (`_octal_text`)."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> Any:
        return _octal_text(node.value) or super().construct_yaml_int(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            if key in first:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} is given twice: lines {first[key]} and {line}",
                    key_node.start_mark,
                )
            first[key] = line
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)


def load_yaml(path: str | Path) -> PipelineConfig:
    try:
        data = yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader) or {}  # noqa: S506 - a SafeLoader
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return validate(data, where=str(path))


def to_yaml(cfg: PipelineConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
