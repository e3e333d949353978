"""The staged files cut into bundles of at most a given size, each with the whole index."""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aerie.errors import ConfigError, IntegrityError
from tools.gpuhost.files import FORMAT, MIB, sha256_file, write_json

CONTENTS = "contents.json"


@dataclass
class StagedFile:
    """One file the host needs: where it goes under HOME/staged, and where its bytes are here."""

    path: str
    source: Path
    expand_to: str | None = None  # an .xz file the host decompresses to this path (under staged/)
    size: int = 0
    sha256: str = ""

    def measure(self) -> None:
        self.size = self.source.stat().st_size
        self.sha256 = sha256_file(self.source)


def plan_bundles(files: list[StagedFile], capacity: int) -> dict[str, Any]:
    """The staging index: every file with its parts, filled into bundles of at most `capacity` bytes
    in order (a file that does not fit is split at the bundle boundary)."""
    if capacity <= 0:
        raise ConfigError(f"the bundle capacity must be positive, got {capacity} bytes")
    entries: list[dict[str, Any]] = []
    bundle, room = 1, capacity
    for f in files:
        parts: list[dict[str, Any]] = []
        offset = 0
        while offset < f.size or not parts:
            if room == 0:
                bundle, room = bundle + 1, capacity
            size = min(room, f.size - offset)
            parts.append({"bundle": f"bundle-{bundle}", "offset": offset, "size": size})
            offset += size
            room -= size
        for i, part in enumerate(parts, start=1):
            part["file"] = f.path if len(parts) == 1 else f"{f.path}.part{i}of{len(parts)}"
        entry = {"path": f.path, "size": f.size, "sha256": f.sha256, "parts": parts}
        entries.append(entry | ({"expand_to": f.expand_to} if f.expand_to else {}))
    listing = [[e["path"], e["size"], e["sha256"]] for e in entries]
    stage_id = hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:12]
    return {"format": FORMAT, "id": stage_id, "files": entries, "bundles": bundle}


def _copy_range(source: Path, dest: Path, offset: int, size: int) -> str:
    """Copy `size` bytes at `offset`; returns their sha256."""
    digest = hashlib.sha256()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as src, open(dest, "wb") as out:
        src.seek(offset)
        left = size
        while left:
            block = src.read(min(left, 8 * MIB))
            if not block:
                raise IntegrityError(
                    f"{source} changed while it was being staged (ends before {offset + size})"
                )
            digest.update(block)
            out.write(block)
            left -= len(block)
    return digest.hexdigest()


def write_bundles(files: list[StagedFile], index: dict[str, Any], out: Path) -> list[tuple[str, int]]:
    """Write `out/bundle-K/` (the parts + contents.json, which holds the whole index) for every bundle."""
    for old in out.glob("bundle-*"):
        shutil.rmtree(old)
    by_path = {f.path: f for f in files}
    for entry in index["files"]:
        for part in entry["parts"]:
            dest = out / part["bundle"] / part["file"]
            part["sha256"] = _copy_range(by_path[entry["path"]].source, dest, part["offset"], part["size"])
    sizes = []
    for k in range(1, index["bundles"] + 1):
        name = f"bundle-{k}"
        write_json(out / name / CONTENTS, {**index, "bundle": name})
        total = sum(p.stat().st_size for p in (out / name).rglob("*") if p.is_file())
        sizes.append((name, total))
    return sizes
