"""The config a host runs: the preset with overrides, its store in the home, checked against the staged
ShareGPT export."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from aerie.bundle.data import SHAREGPT_EXPORT
from aerie.bundle.files import read_json
from aerie.bundle.layout import InstallDir as Home
from aerie.errors import ConfigError


def host_config(home: Home, preset: str, overrides: list[str], store: Path) -> Path:
    """Write the preset (with overrides) as YAML for this host, its store in the home. The datasets stay
    as they are (the stand-in packages serve them); raises when the staged ShareGPT export cannot serve
    them as configured."""
    from aerie.config import to_yaml
    from aerie.presets import load_config  # pydantic: only once the wheels are installed

    cfg = load_config(preset, [*overrides, f"store.uri={store}"])
    export_path = home.staged / SHAREGPT_EXPORT
    for dataset in cfg.generate.datasets:
        if dataset.source.kind == "sharegpt":
            export = read_json(export_path, f"the staged ShareGPT export (dataset {dataset.name!r} reads it)")
            _check_export(dataset.model_dump(mode="json"), export)
    text = to_yaml(cfg)
    path = home.root / "configs" / f"{cfg.preset}-{hashlib.sha256(text.encode()).hexdigest()[:8]}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _check_export(dataset: dict[str, Any], export: dict[str, Any]) -> None:
    name = dataset["name"]
    if dataset["source"] != export["source"]:
        raise ConfigError(
            f"dataset {name!r}: the staged ShareGPT export was read with source {export['source']}, this "
            f"config asks for {dataset['source']}; stage again with the same preset and overrides"
        )
    wanted = dataset["num_samples"]
    if not export["complete"] and (wanted is None or wanted > export["conversations"]):
        raise ConfigError(
            f"dataset {name!r}: {wanted or 'all'} conversations asked for, the staged export holds the first "
            f"{export['conversations']}; stage again with num_samples={wanted}"
        )
    if export["assistant_placeholder"] and not dataset["regenerate"]:
        raise ConfigError(
            f"dataset {name!r} keeps the data's assistant turns, but the staged export replaced them with "
            "placeholders; stage again with --full-text"
        )
