"""Drafter families: a typed registry of what differs between drafters (`aerie.families.spec.Family`).

    family("dflash").objective.load()(cfg)      a part, imported when used
    family_of(cfg.train.drafter).deployable     the family a `train.drafter` section names

A family is its parts (model, objective, export and loader, proposer: modules of its own) plus one
`Family` declaration and one line in `BUILTIN` below, a `register(...)` call before the config loads,
or an entry point in the group `aerie.families` naming the declaration (a plug-in: every process
finds it, the reference server's included; `docs/extending.md`). The parts' protocols are
`aerie.families.protocols`. Nothing outside this package branches on a family's name; the config
checks what a family cannot do (deploy, captures) when it loads.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Annotated, Any

from pydantic import BeforeValidator, SerializeAsAny, ValidationError, WithJsonSchema

from aerie.errors import ConfigError
from aerie.families.dflash import DFLASH, DFlashSettings, spread_layers
from aerie.families.eagle3 import EAGLE3, Eagle3Settings, eagle3_layers
from aerie.families.spec import DrafterSettings, Family, Part

__all__ = [
    "DEFAULT",
    "DFlashSettings",
    "DrafterSettings",
    "DrafterSection",
    "Eagle3Settings",
    "Family",
    "Part",
    "default_settings",
    "eagle3_layers",
    "family",
    "family_of",
    "names",
    "register",
    "serving",
    "spread_layers",
    "unregister",
]

BUILTIN: tuple[Family, ...] = (EAGLE3, DFLASH)
# The family a config names when it names none; the evaluator's default proposer list names it too, and
# a run training another family measures its own drafter in its place.
DEFAULT = EAGLE3.name

ENTRY_POINTS = "aerie.families"  # plug-ins: each entry point names a `Family`

_REGISTRY: dict[str, Family] = {f.name: f for f in BUILTIN}
_plugins_loaded = False


def _registry() -> dict[str, Family]:
    """The families, plug-ins loaded on first use (a plug-in's module may import this package)."""
    global _plugins_loaded
    if not _plugins_loaded:
        _plugins_loaded = True
        for point in entry_points(group=ENTRY_POINTS):
            entry = point.load()
            if not isinstance(entry, Family):
                raise ConfigError(
                    f"entry point {point.name} = {point.value} ({ENTRY_POINTS}) is not a Family"
                )
            register(entry)
    return _REGISTRY


def register(entry: Family) -> Family:
    """Add a family (a name taken by another declaration is refused)."""
    known = _REGISTRY.get(entry.name)
    if known is not None and known is not entry:
        raise ConfigError(f"drafter family {entry.name!r} is registered already")
    _REGISTRY[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Remove a family added with `register` (the built-in ones stay)."""
    if name in {f.name for f in BUILTIN}:
        raise ConfigError(f"drafter family {name!r} is built in")
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_registry())


def family(name: str) -> Family:
    try:
        return _registry()[name]
    except KeyError:
        raise ConfigError(f"unknown drafter family {name!r}; allowed: {', '.join(_REGISTRY)}") from None


def serving(algorithm: str) -> Family:
    """The family whose drafters a server runs under SGLang's `--speculative-algorithm` `algorithm`."""
    for entry in _registry().values():
        if entry.served_algorithm == algorithm:
            return entry
    served = ", ".join(f.served_algorithm for f in _REGISTRY.values())
    raise ConfigError(f"no drafter family is served as {algorithm!r}; served algorithms: {served}")


def family_of(settings: DrafterSettings) -> Family:
    return family(settings.family)


def default_settings() -> DrafterSettings:
    return family(DEFAULT).config.model_validate({})


def _settings(value: Any) -> Any:
    """`train.drafter` as its family's config: a family's name alone takes its defaults; a mapping
    names its family under `family` (the default family where it names none)."""
    if isinstance(value, DrafterSettings):
        return value
    if isinstance(value, str):
        value = {"family": value}
    if not isinstance(value, dict):
        raise ValueError(f"a drafter family's name or a mapping of its settings, got {value!r}")
    name = value.get("family", DEFAULT)
    if name not in _registry():
        raise ValueError(f"unknown drafter family {name!r}; allowed: {', '.join(_REGISTRY)}")
    config = _REGISTRY[name].config
    try:
        return config.model_validate({**value, "family": name})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                problems.append(f"{where}: not a {name} setting; allowed: {', '.join(config.model_fields)}")
            else:
                problems.append(f"{where}: {err['msg']} [got {err.get('input')!r}]")
        raise ValueError(f"{name}: " + "; ".join(problems)) from None


# Its JSON schema (what Prefect checks a deployment's parameters against): a mapping under a family's
# name, whose other keys the family checks, or the name alone; the base settings' schema would refuse every family's own.
_SECTION_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "family": {"type": "string", "description": "the drafter family (aerie.families)"}
            },
            "additionalProperties": True,
        },
        {"type": "string", "description": "a family's name alone: its defaults"},
    ]
}

# The type of `train.drafter`: validated by the family it names, serialized with all its fields.
DrafterSection = Annotated[
    SerializeAsAny[DrafterSettings], BeforeValidator(_settings), WithJsonSchema(_SECTION_SCHEMA)
]
