"""aerie: train speculative-decoding drafters (EAGLE-3, DFlash) end to end.

The library is Prefect-free: each stage is a package keeping the contract of `aerie.stage`, and
`aerie.pipeline` runs them in order; the Prefect flows (`aerie.flows`, the repository's `flows/`) only
compose, retry and report. The names below are the public surface:

    cfg = aerie.load_config("smollm2-local", ["train.epochs=2"])   # a preset or a YAML file, overridden
    report = aerie.run_pipeline(cfg, until="train")               # every stage cached on its manifest
    print(report.table())

They are imported when first used, so `import aerie` stays light (the code that runs inside the SGLang
server imports `aerie.sglang_plugin` and nothing else of the library).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from aerie.version import __version__

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "AerieError": "aerie.errors",
    "ConfigError": "aerie.errors",
    "Family": "aerie.families",
    "PipelineConfig": "aerie.config",
    "PipelineReport": "aerie.pipeline",
    "Stage": "aerie.stage",
    "StageContext": "aerie.stage",
    "StageResult": "aerie.manifest",
    "Upstream": "aerie.stage",
    "apply_overrides": "aerie.config",
    "get_preset": "aerie.presets",
    "load_config": "aerie.presets",
    "open_store": "aerie.store",
    "register_family": "aerie.families",
    "resolve_target": "aerie.targets",
    "run_pipeline": "aerie.pipeline",
}
_RENAMED = {"register_family": "register"}

__all__ = [
    "__version__",
    "AerieError",
    "ConfigError",
    "Family",
    "PipelineConfig",
    "PipelineReport",
    "Stage",
    "StageContext",
    "StageResult",
    "Upstream",
    "apply_overrides",
    "get_preset",
    "load_config",
    "open_store",
    "register_family",
    "resolve_target",
    "run_pipeline",
]

if TYPE_CHECKING:
    from aerie.config import PipelineConfig, apply_overrides
    from aerie.errors import AerieError, ConfigError
    from aerie.families import Family
    from aerie.families import register as register_family
    from aerie.manifest import StageResult
    from aerie.pipeline import PipelineReport, run_pipeline
    from aerie.presets import get_preset, load_config
    from aerie.stage import Stage, StageContext, Upstream
    from aerie.store import open_store
    from aerie.targets import resolve_target


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'aerie' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), _RENAMED.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
