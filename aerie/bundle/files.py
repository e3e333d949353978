"""How a bundle's files are written and checked on both sides: JSON written atomically, JSON read with
errors that name the file, sha256 in blocks, sizes for people. Standard library only: the offline side
runs this before any wheel is installed."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from aerie.errors import ConfigError, SourceNotFoundError

FORMAT = 1  # the layout of contents.json; unpack refuses any other
MIB = 1 << 20


def temp_beside(path: Path) -> Path:
    """Where a file is written before it is renamed to `path`: hidden, so nothing takes a half-written one."""
    return path.with_name(f".{path.name}.tmp")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * MIB):
            digest.update(block)
    return digest.hexdigest()


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_beside(path)
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SourceNotFoundError(f"{what} not found: {path}") from None
    except ValueError as exc:
        raise ConfigError(f"{what} at {path} is not valid JSON: {exc}") from exc


def size_text(n: int) -> str:
    """`12.3 MiB`, or `45.6 KiB` below a tenth of a MiB."""
    return f"{n / MIB:.1f} MiB" if n >= MIB // 10 else f"{n / 1024:.1f} KiB"
