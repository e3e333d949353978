"""What the planner knows before anything runs: the target's architecture, the hardware's datasheet and
the measured rates (`data/*.json`, read once)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from aerie.errors import ConfigError, TargetError
from aerie.targets import TargetConfig

DATA = Path(__file__).parent / "data"


@cache
def _data(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


@dataclass(frozen=True)
class TargetFacts:
    """The target's sizes the estimates need."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    active_params: float
    weight_bytes: float
    source: str
    tokenizer_path: str | None = None


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
    """The target's facts: from its own config when it resolves on this machine (no download, no
    torch), else from the planner's table of known targets."""
    from aerie.targets import resolve_target

    try:
        info = resolve_target(cfg)
    except TargetError:
        known = _known(cfg.name)
        if known is None:
            raise ConfigError(
                f"target {cfg.name!r} is not on this machine and not among the targets the planner knows "
                f"({', '.join(_data('targets.json')['targets'])}): put it in the local HF cache first"
            ) from None
        fields = {k: v for k, v in known.items() if k in TargetFacts.__dataclass_fields__}
        return TargetFacts(
            name=cfg.name, source="the planner's table (aerie/plan/data/targets.json)", **fields
        )
    # Parameters from the weights' bytes where the table does not know the target: 2 bytes each, as
    # the embedded bf16 conversion and most HF checkpoints store them.
    known = _known(cfg.name)
    params = known["active_params"] if known else info.size_bytes / 2
    tokenizer = Path(info.path) / "tokenizer.json"
    return TargetFacts(
        name=info.name,
        num_layers=info.num_layers,
        hidden_size=info.hidden_size,
        intermediate_size=info.intermediate_size,
        num_attention_heads=info.num_attention_heads,
        num_key_value_heads=info.num_key_value_heads,
        head_dim=info.head_dim,
        vocab_size=info.vocab_size,
        max_position_embeddings=info.max_position_embeddings,
        active_params=float(params),
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
