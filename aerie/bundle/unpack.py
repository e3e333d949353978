"""`unpack`: one part of a bundle copied into the install folder and checked, split files reassembled,
.xz files expanded. Idempotent, so parts may arrive in any order and a part may be unpacked twice."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aerie.bundle.files import FORMAT, MIB, read_json, temp_beside, write_json
from aerie.bundle.layout import InstallDir
from aerie.bundle.parts import CONTENTS
from aerie.errors import ConfigError, SourceNotFoundError


@dataclass
class UnpackReport:
    placed: list[str] = field(default_factory=list)
    assembled: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # "path part i/n (in bundle-K)"


def _is_verified(dest: InstallDir, rel: str, size: int, sha: str, verified: dict[str, str]) -> bool:
    path = dest.root / rel
    return verified.get(rel) == sha and path.is_file() and path.stat().st_size == size


def _place(sources: list[Path], dest: Path, expected: str) -> bool:
    """Copy `sources` one after another to `dest` through a temp file, hashing on the way; False (and
    nothing placed) when the sha256 differs from `expected`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_beside(dest)
    digest = hashlib.sha256()
    with open(tmp, "wb") as fout:
        for src in sources:
            with open(src, "rb") as fin:
                while block := fin.read(8 * MIB):
                    digest.update(block)
                    fout.write(block)
    if digest.hexdigest() != expected:
        tmp.unlink()
        return False
    os.replace(tmp, dest)
    return True


def unpack(bundle_dir: Path, dest: InstallDir) -> UnpackReport:
    """Copy one part folder's pieces into the install folder (each checked against its sha256), reassemble
    every split file whose pieces are all there (checked again as a whole), and list what is still
    missing. Idempotent: verified files are not copied again."""
    contents = read_json(bundle_dir / CONTENTS, f"{bundle_dir} is not a part of a bundle:")
    if contents.get("format") != FORMAT:
        raise ConfigError(f"{bundle_dir}: bundle format {contents.get('format')}, this aerie reads {FORMAT}")
    dest.root.mkdir(parents=True, exist_ok=True)
    if not dest.created_path.exists():
        dest.created_path.touch()
    if dest.index_path.is_file() and dest.index().get("id") != contents["id"]:
        print(f"note: {bundle_dir} is from bundle {contents['id']}; {dest.root} held another bundle's files")
    index = {k: v for k, v in contents.items() if k != "bundle"}
    write_json(dest.index_path, index)
    verified = dest.verified()
    report = UnpackReport()
    for entry in index["files"]:
        single = len(entry["parts"]) == 1
        if _is_verified(dest, f"staged/{entry['path']}", entry["size"], entry["sha256"], verified):
            continue  # reassembled earlier: its parts were deleted then and are not wanted again
        for part in entry["parts"]:
            if part["bundle"] != contents["bundle"]:
                continue
            rel = f"staged/{entry['path']}" if single else f".parts/{part['file']}"
            if _is_verified(dest, rel, part["size"], part["sha256"], verified):
                continue
            src = bundle_dir / part["file"]
            if not src.is_file():
                report.corrupt.append(f"{src}: listed in {CONTENTS} but absent")
                continue
            if not _place([src], dest.root / rel, part["sha256"]):
                report.corrupt.append(f"{src}: sha256 differs from {CONTENTS} (damaged in transfer)")
                continue
            verified[rel] = part["sha256"]
            report.placed.append(rel)
        write_json(dest.verified_path, verified)
    for entry in index["files"]:
        _assemble(dest, entry, verified, report)
        if entry.get("expand_to"):
            _expand(dest, entry, verified, report)
    write_json(dest.verified_path, verified)
    return report


def _expand(dest: InstallDir, entry: dict[str, Any], verified: dict[str, str], report: UnpackReport) -> None:
    """Decompress a verified .xz file to where its `expand_to` says (once per version of it)."""
    import lzma

    rel, target = f"staged/{entry['path']}", dest.staged / entry["expand_to"]
    if not _is_verified(dest, rel, entry["size"], entry["sha256"], verified):
        return
    if verified.get(f"expanded:{entry['expand_to']}") == entry["sha256"] and target.is_file():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_beside(target)
    with lzma.open(dest.root / rel, "rb") as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 8 * MIB)
    os.replace(tmp, target)
    verified[f"expanded:{entry['expand_to']}"] = entry["sha256"]
    report.assembled.append(entry["expand_to"])


def _assemble(
    dest: InstallDir, entry: dict[str, Any], verified: dict[str, str], report: UnpackReport
) -> None:
    rel = f"staged/{entry['path']}"
    if _is_verified(dest, rel, entry["size"], entry["sha256"], verified):
        return
    parts = entry["parts"]
    absent = [
        (i, p)
        for i, p in enumerate(parts, start=1)
        if len(parts) == 1 or not _is_verified(dest, f".parts/{p['file']}", p["size"], p["sha256"], verified)
    ]
    if absent:
        report.missing += [
            f"{entry['path']}"
            + (f" part {i}/{len(parts)}" if len(parts) > 1 else "")
            + f" (in {p['bundle']})"
            for i, p in absent
        ]
        return
    if not _place([dest.parts / p["file"] for p in parts], dest.root / rel, entry["sha256"]):
        report.corrupt.append(f"{entry['path']}: the reassembled file's sha256 differs from the index")
        return
    verified[rel] = entry["sha256"]
    for p in parts:
        (dest.parts / p["file"]).unlink(missing_ok=True)
        verified.pop(f".parts/{p['file']}", None)
    for d in sorted((p for p in dest.parts.rglob("*") if p.is_dir()), reverse=True):
        with contextlib.suppress(OSError):
            d.rmdir()  # only empty ones go: parts of other files may still wait in the tree
    report.assembled.append(entry["path"])


def missing_files(dest: InstallDir, prefix: str = "") -> list[str]:
    """The bundle's files (under `prefix`) not yet in place and verified, with the parts that hold them."""
    index, verified = dest.index(), dest.verified()
    out = []
    for entry in index["files"]:
        if entry["path"].startswith(prefix) and not _is_verified(
            dest, f"staged/{entry['path']}", entry["size"], entry["sha256"], verified
        ):
            bundles = sorted({p["bundle"] for p in entry["parts"]})
            out.append(f"{entry['path']} (from {', '.join(bundles)})")
    return out


def require_unpacked(dest: InstallDir, prefix: str, what: str) -> None:
    """Raise, naming what is missing and from which part, unless every bundled file under `prefix` is in."""
    missing = missing_files(dest, prefix)
    if missing:
        raise SourceNotFoundError(
            f"{what} needs files of the bundle that are not unpacked yet: " + "; ".join(missing)
        )
