"""What the planner knows before anything runs: the target's architecture, the hardware's datasheet and
the measured rates (`data/*.json`, read once)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from aerie.errors import ConfigError, TargetError
from aerie.targets import TargetConfig, TargetGeometry, geometry_of

DATA = Path(__file__).parent / "data"


@cache
def _data(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


@dataclass(frozen=True)
class TargetFacts:
    """The target the estimates are for: its geometry (from its config.json, the one `aerie.targets`
    reads for the stages; the planner reads its sizes there) and what the geometry cannot say: its
    checkpoint's bytes."""

    name: str
    geometry: TargetGeometry
    weight_bytes: float
    source: str
    tokenizer_path: str | None = None

    @property
    def active_params(self) -> float:
        """Weights one token runs through (MoE: its active and shared experts), from the geometry."""
        return float(self.geometry.params()[1])

    @property
    def total_params(self) -> float:
        return float(self.geometry.params()[0])


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    peak_flops: float
    memory_bandwidth: float
    memory_bytes: float
    gpu: bool


def _known(name: str) -> dict[str, Any] | None:
    return _data("targets.json")["targets"].get(name)  # type: ignore[no-any-return]


def target_facts(cfg: TargetConfig) -> TargetFacts:
    """The target's facts: from its own directory when it resolves on this machine (no download, no
    torch), else from the config.json aerie ships for the targets the planner knows
    (`aerie/known_targets`) and the checkpoint bytes in `data/targets.json`."""
    from aerie.targets import known_target_dir, resolve_target

    try:
        info = resolve_target(cfg)
    except TargetError:
        known, folder = _known(cfg.name), known_target_dir(cfg.name)
        if known is None or folder is None:
            raise ConfigError(
                f"target {cfg.name!r} is not on this machine and not among the targets the planner knows "
                f"({', '.join(_data('targets.json')['targets'])}): put it in the local HF cache first"
            ) from None
        return TargetFacts(
            name=cfg.name,
            geometry=geometry_of(folder),
            weight_bytes=float(known["weight_bytes"]),
            source=f"the config aerie ships ({folder.name}/config.json) and data/targets.json",
        )
    tokenizer = Path(info.path) / "tokenizer.json"
    return TargetFacts(
        name=info.name,
        geometry=info.geometry,
        weight_bytes=float(info.size_bytes),
        source=f"its config at {info.path}",
        tokenizer_path=str(tokenizer) if tokenizer.is_file() else None,
    )


def hardware(name: str) -> Hardware:
    table = _data("hardware.json")["hardware"]
    if name not in table:
        raise ConfigError(f"unknown hardware {name!r}; known: {', '.join(table)}")
    return Hardware(name=name, **table[name])


def hardware_names() -> list[str]:
    return list(_data("hardware.json")["hardware"])


@dataclass(frozen=True)
class Rate:
    """One measured figure and the record it came from."""

    value: float
    source: str
    what: str

    def cite(self) -> str:
        return f"{self.what} ({self.source})"


def rates(hardware_name: str) -> dict[str, Rate] | None:
    """The measured rates of this hardware, or None when none were measured on it."""
    table = _data("calibration.json")["hardware"].get(hardware_name)
    if table is None:
        return None
    return {
        key: Rate(
            value=r["value"] * r.get("scale", 1.0), source=f"benchmarks/results/{r['source']}", what=r["what"]
        )
        for key, r in table.items()
    }


def calibration_entries() -> dict[str, dict[str, dict[str, Any]]]:
    """The raw calibration table (what the tests compare with the benchmark records)."""
    return _data("calibration.json")["hardware"]  # type: ignore[no-any-return]


def figure_at(record: Any, path: str) -> Any:
    """The figure a calibration entry cites: `path` is keys and list indices joined by '/'."""
    for part in path.split("/"):
        record = record[int(part)] if isinstance(record, list) else record[part]
    return record
