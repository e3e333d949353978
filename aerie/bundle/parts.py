"""A bundle's files cut into part folders of at most a given size, each holding the whole index.

A file larger than the room left in a part is split at the part's boundary; `unpack` puts the pieces
back together once every part that holds one has been unpacked. The index keys say `bundle` for a part
folder (`part-K`, or another prefix), as the first bundles were written."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aerie.bundle.files import FORMAT, MIB, sha256_file, write_json
from aerie.errors import ConfigError, IntegrityError

CONTENTS = "contents.json"


@dataclass
class BundledFile:
    """One file the offline host needs: where it goes under staged/, and where its bytes are here."""

    path: str
    source: Path
    expand_to: str | None = None  # an .xz file unpack decompresses to this path (under staged/)
    size: int = 0
    sha256: str = ""

    def measure(self) -> None:
        self.size = self.source.stat().st_size
        self.sha256 = sha256_file(self.source)


def plan_parts(files: list[BundledFile], capacity: int, prefix: str = "part") -> dict[str, Any]:
    """The bundle's index: every file with its pieces, filled into part folders `PREFIX-K` of at most
    `capacity` bytes in order (a file that does not fit is split at the part's boundary)."""
    if capacity <= 0:
        raise ConfigError(f"the part size must be positive, got {capacity} bytes")
    entries: list[dict[str, Any]] = []
    bundle, room = 1, capacity
    for f in files:
        parts: list[dict[str, Any]] = []
        offset = 0
        while offset < f.size or not parts:
            if room == 0:
                bundle, room = bundle + 1, capacity
            size = min(room, f.size - offset)
            parts.append({"bundle": f"{prefix}-{bundle}", "offset": offset, "size": size})
            offset += size
            room -= size
        for i, part in enumerate(parts, start=1):
            part["file"] = f.path if len(parts) == 1 else f"{f.path}.part{i}of{len(parts)}"
        entry = {"path": f.path, "size": f.size, "sha256": f.sha256, "parts": parts}
        entries.append(entry | ({"expand_to": f.expand_to} if f.expand_to else {}))
    listing = [[e["path"], e["size"], e["sha256"]] for e in entries]
    stage_id = hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:12]
    return {"format": FORMAT, "id": stage_id, "files": entries, "bundles": bundle, "prefix": prefix}


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
                    f"{source} changed while it was being bundled (ends before {offset + size})"
                )
            digest.update(block)
            out.write(block)
            left -= len(block)
    return digest.hexdigest()


def write_parts(
    files: list[BundledFile], index: dict[str, Any], out: Path, extras: Sequence[Path] = ()
) -> list[tuple[str, int]]:
    """Write `out/PREFIX-K/` for every part: its pieces, contents.json (the whole index) and the `extras`
    (copied into every part: the installer). Returns each part's name and size."""
    prefix = index.get("prefix", "part")
    for old in out.glob(f"{prefix}-*"):
        shutil.rmtree(old)
    by_path = {f.path: f for f in files}
    for entry in index["files"]:
        for part in entry["parts"]:
            dest = out / part["bundle"] / part["file"]
            part["sha256"] = _copy_range(by_path[entry["path"]].source, dest, part["offset"], part["size"])
    sizes = []
    for k in range(1, index["bundles"] + 1):
        name = f"{prefix}-{k}"
        write_json(out / name / CONTENTS, {**index, "bundle": name})
        for extra in extras:
            shutil.copy2(extra, out / name / extra.name)
        total = sum(p.stat().st_size for p in (out / name).rglob("*") if p.is_file())
        sizes.append((name, total))
    return sizes
