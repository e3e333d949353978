"""`restore`: pack-out archives checked against their index and unpacked into a (fresh) home."""

from __future__ import annotations

import gzip
import io
import os
import re
import shutil
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from aerie.bundle.files import MIB, read_json, sha256_file, temp_beside
from aerie.bundle.layout import InstallDir as Home
from aerie.errors import IntegrityError, SourceNotFoundError
from tools.gpuhost.packout import STATE_INDEX


class _Concat(io.RawIOBase):
    """The archive parts read back as one stream."""

    def __init__(self, paths: list[Path]) -> None:
        super().__init__()
        self._paths = list(paths)
        self._f: IO[bytes] | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while True:
            if self._f is None:
                if not self._paths:
                    return 0
                self._f = open(self._paths.pop(0), "rb")  # noqa: SIM115 - open across readinto() calls
            n = self._f.readinto(buffer)  # type: ignore[attr-defined]
            if n:
                return int(n)
            self._f.close()
            self._f = None

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        super().close()


def _state_parts(archives: Sequence[Path]) -> list[Path]:
    """The archive parts to read, in order; checked against state.json (all there, sha256) when given."""
    files: list[Path] = []
    for a in archives:
        files += sorted(a.iterdir()) if a.is_dir() else [a]
    parts = sorted((f for f in files if re.fullmatch(r"state\.tgz\.\d{3}", f.name)), key=lambda f: f.name)
    index_file = next((f for f in files if f.name == STATE_INDEX), None)
    if index_file is None:
        if not parts:
            raise SourceNotFoundError(f"no state.tgz.NNN parts among {', '.join(map(str, archives))}")
        return parts
    index = read_json(index_file, "the pack-out index")
    by_name = {p.name: p for p in parts}
    missing = [p["file"] for p in index["parts"] if p["file"] not in by_name]
    if missing:
        raise SourceNotFoundError(
            f"{index_file} lists {', '.join(missing)}, which were not given: send every part"
        )
    for part in index["parts"]:
        path = by_name[part["file"]]
        if path.stat().st_size != part["size"] or sha256_file(path) != part["sha256"]:
            raise IntegrityError(f"{path}: size or sha256 differs from {index_file} (damaged in transfer)")
    return [by_name[p["file"]] for p in index["parts"]]


def restore(home: Home, archives: Sequence[Path]) -> tuple[int, int]:
    """Unpack pack-out archives into the home: `store/` into the store, `results/` beside it. A file
    already there is kept (on a warm host it is as new as the archive or newer). Returns (restored,
    kept)."""
    parts = _state_parts(archives)
    restored = kept = 0
    root = home.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    with (
        gzip.GzipFile(fileobj=io.BufferedReader(_Concat(parts), 1 * MIB)) as stream,
        tarfile.open(fileobj=stream, mode="r|", ignore_zeros=True) as tar,
    ):
        for member in tar:
            dest = (root / member.name).resolve()
            if (
                not member.isfile()
                or not member.name.startswith(("store/", "results/"))
                or root not in dest.parents
            ):
                raise IntegrityError(
                    f"{parts[0]}: unexpected archive member {member.name!r}: not a pack-out archive"
                )
            if dest.exists():
                kept += 1
                continue
            src = tar.extractfile(member)
            assert src is not None  # a regular file, checked above
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = temp_beside(dest)
            with open(tmp, "wb") as f:
                shutil.copyfileobj(src, f)
            os.utime(tmp, (member.mtime, member.mtime))
            os.replace(tmp, dest)
            restored += 1
    return restored, kept
