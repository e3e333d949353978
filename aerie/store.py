"""Artifact stores: where every stage writes, addressed by keys under one root URI.

`LocalStore` (a directory, default `./artifacts`) and `S3Store` (boto3) share the `ArtifactStore`
protocol and one conformance suite (`tests/test_store.py`). Keys are `/`-separated relative paths
(`<run>/<stage>/<key>/file`) with no empty part and no part starting with '.' (those names hold temp
files and checksums); URIs are plain `str` (a `Path` would collapse the `//` of `s3://`).
`list("a/b")` treats its prefix as a directory: `a/b/...` (or the object `a/b`), never `a/bc`.

Guarantees: an upload is atomic (a reader never sees a partial object, an interrupted upload leaves
nothing, what was under the key before survives); every object's sha256 is recorded at upload and
verified on download (`IntegrityError` on mismatch; a failed download never lands at its destination).
`adopt_file` is an upload that takes the file over: a LocalStore renames it into place (no second
write), an S3Store uploads it and deletes it once the stored object is verified.
Errors are `StoreError`s (`ObjectNotFoundError` for a missing key) that name the object.
The contract itself (protocol, config, key rules) lives in `aerie.store_api`, re-exported here.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from aerie.diskspace import cannot_write, free_text
from aerie.errors import IntegrityError, ObjectNotFoundError, StoreError
from aerie.progress import ProgressFn
from aerie.store_api import (
    CHUNK,
    MIB,
    ArtifactStore,
    ByteProgress,
    ObjectInfo,
    StoreConfig,
    check_adopted,
    check_key,
    dir_mode,
    file_mode,
    sha256_file,
    sha256_of,
    unlink_adopted,
)

__all__ = [
    "CHUNK",
    "MIB",
    "ArtifactStore",
    "ByteProgress",
    "LocalStore",
    "ObjectInfo",
    "StoreConfig",
    "check_adopted",
    "check_key",
    "open_store",
    "sha256_file",
    "unlink_adopted",
]


class LocalStore:
    """A directory. Objects are written to a temp file beside the target, fsync'd, then renamed;
    each object's sha256 sits in a hidden sidecar `.<name>.sha256` next to it.

    Permissions: an object gets what the umask allows (as a file any program writes: 0644 under the
    usual 022), or `mode` (`store.mode`, e.g. 0o640) with its directories the same plus search."""

    def __init__(self, root: str | Path = "./artifacts", *, mode: int | None = None) -> None:
        self._root = Path(root).expanduser().resolve()
        self.root = str(self._root)
        self._mode = mode

    def _mkdirs(self, path: Path) -> None:
        """`path` and its missing parents; with a `mode`, each one created gets its directory mode."""
        if self._mode is None:
            path.mkdir(parents=True, exist_ok=True)
            return
        missing = []
        while not path.exists():
            missing.append(path)
            path = path.parent
        for folder in reversed(missing):
            folder.mkdir(exist_ok=True)
            os.chmod(folder, dir_mode(self._mode))  # mkdir's mode is cut by the umask

    def _path(self, key: str) -> Path:
        return self._root / check_key(key)

    @staticmethod
    def _sidecar(path: Path) -> Path:
        return path.with_name(f".{path.name}.sha256")

    def uri(self, key: str) -> str:
        return str(self._path(key))

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    @contextmanager
    def _atomic(self, key: str) -> Iterator[tuple[BinaryIO, Path]]:
        dest = self._path(key)
        began = time.time()
        try:
            self._mkdirs(dest.parent)
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        except OSError as exc:
            raise StoreError(cannot_write(dest, exc)) from exc
        try:
            os.fchmod(fd, file_mode(self._mode))  # mkstemp's 0600 would hide the object from others
            with os.fdopen(fd, "wb") as f:
                yield f, dest
                f.flush()
                os.fsync(f.fileno())
            # The old sidecar goes first: a crash before the new one is written leaves an object that
            # is unverified, never one that fails verification against the previous object's digest.
            self._sidecar(dest).unlink(missing_ok=True)
            os.replace(tmp, dest)
            sweep_parts(dest, began)
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise StoreError(cannot_write(dest, exc)) from exc
            raise

    def _record(self, key: str, dest: Path, digest: str) -> ObjectInfo:
        side = self._sidecar(dest)
        tmp = side.with_suffix(".tmp")
        try:
            tmp.write_text(digest)
            if self._mode is not None:
                os.chmod(tmp, self._mode)
            os.replace(tmp, side)
        except OSError as exc:
            raise StoreError(f"cannot write the checksum of {dest} ({free_text(dest)}): {exc}") from exc
        return ObjectInfo(key=check_key(key), uri=str(dest), size=dest.stat().st_size, sha256=digest)

    def put_file(self, key: str, path: str | Path, *, progress: ProgressFn | None = None) -> ObjectInfo:
        return self._copy_in(key, path, progress, want=None)

    def _copy_in(
        self, key: str, path: str | Path, progress: ProgressFn | None, want: str | None
    ) -> ObjectInfo:
        """Copy and hash in one pass into a temp file; rename it over the key only if the digest is
        `want` (when given), so a mismatch leaves the previous object in place."""
        h = hashlib.sha256()
        try:
            src_f = open(path, "rb")  # noqa: SIM115 - closed by the with below; open errors need their own message
            total = os.fstat(src_f.fileno()).st_size
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc}") from exc
        meter = ByteProgress(progress, total, f"upload {key}") if progress else None
        with src_f, self._atomic(key) as (f, dest):
            while block := src_f.read(CHUNK):
                h.update(block)
                f.write(block)
                if meter:
                    meter.add(len(block))
                    meter.report()
            check_adopted(path, want, h.hexdigest())
        info = self._record(key, dest, h.hexdigest())
        if meter:
            meter.finish()
        return info

    def adopt_file(
        self, key: str, path: str | Path, *, sha256: str | None = None, reread: bool = True
    ) -> ObjectInfo:
        """Rename the file into place after one hash-and-fsync pass over it, so it is as durable and
        as checked as a put_file copy without being written twice (with `reread=False` and a
        `sha256`, without that pass: its writer fsynced it). Across filesystems (EXDEV) it is copied
        like put_file, verified, then deleted."""
        src, dest = Path(path), self._path(key)
        if reread or sha256 is None:
            try:
                with open(src, "rb") as f:
                    digest = sha256_of(f)
                    os.fsync(f.fileno())  # put_file's temp file is fsync'd before its rename: the same here
            except OSError as exc:
                raise StoreError(f"cannot read {src}: {exc}") from exc
            check_adopted(src, sha256, digest)
        else:
            digest = sha256
        if src.resolve() == dest.resolve():  # already in place (written straight into the store)
            self._set_mode(dest)
            return self._record(key, dest, digest)
        try:
            self._mkdirs(dest.parent)
            # The old sidecar goes first, as in _atomic: a crash in between leaves an unverified
            # object, never one checked against the previous object's digest.
            self._sidecar(dest).unlink(missing_ok=True)
            os.replace(src, dest)
            self._set_mode(dest)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise StoreError(f"cannot move {src} to {dest}: {exc}") from exc
            info = self._copy_in(key, src, None, want=digest)
            unlink_adopted(src, info.uri)
            return info
        return self._record(key, dest, digest)

    def _set_mode(self, path: Path) -> None:
        """An adopted file gets an object's permissions (its writer may have made it private)."""
        try:
            os.chmod(path, file_mode(self._mode))
        except OSError as exc:
            raise StoreError(f"cannot set the permissions of {path}: {exc}") from exc

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        with self._atomic(key) as (f, dest):
            f.write(data)
        return self._record(key, dest, hashlib.sha256(data).hexdigest())

    def _existing(self, key: str) -> tuple[Path, str | None]:
        """The object's path and its recorded sha256 (None for an object written without one)."""
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFoundError(f"no artifact {key!r} in {self.root}")
        side = self._sidecar(path)
        return path, side.read_text().strip() if side.exists() else None

    @staticmethod
    def _check(path: Path, want: str | None, got: str) -> None:
        if want is not None and got != want:
            raise IntegrityError(
                f"{path}: sha256 {got[:12]}… does not match the recorded {want[:12]}…; the object is "
                f"corrupt: {_remedy(path)}"
            )

    def _verified(self, key: str) -> Path:
        path, want = self._existing(key)
        if want is not None:
            self._check(path, want, sha256_file(path))
        return path

    def get_file(self, key: str, path: str | Path, *, progress: ProgressFn | None = None) -> Path:
        src, want = self._existing(key)
        dest = Path(path)
        if dest.exists() and src.resolve() == dest.resolve():
            self._verified(key)
            return dest
        meter = ByteProgress(progress, src.stat().st_size, f"download {key}") if progress else None
        # Copy and hash in one pass into a temp file beside `dest`; rename only once verified.
        h = hashlib.sha256()
        began = time.time()
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
            os.fchmod(fd, file_mode())  # a copy out of the store is an ordinary file: the umask's
        except OSError as exc:
            raise StoreError(cannot_write(dest, exc)) from exc
        try:
            with os.fdopen(fd, "wb") as out, open(src, "rb") as f:
                while block := f.read(CHUNK):
                    h.update(block)
                    out.write(block)
                    if meter:
                        meter.add(len(block))
                        meter.report()
            self._check(src, want, h.hexdigest())
            os.replace(tmp, dest)
            sweep_parts(dest, began)
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise StoreError(f"cannot copy {src} to {dest}: {exc}") from exc
            raise
        if meter:
            meter.finish()
        return dest

    def get_bytes(self, key: str) -> bytes:
        path, want = self._existing(key)
        data = path.read_bytes()
        self._check(path, want, hashlib.sha256(data).hexdigest())
        return data

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        base = self._path(prefix) if prefix.strip("/") else self._root
        if not base.exists():
            return []
        files = [base] if base.is_file() else base.rglob("*")
        keys = (p.relative_to(self._root).as_posix() for p in files if p.is_file())
        # Temp files and sidecars have a part starting with '.', which valid keys never have.
        return sorted(k for k in keys if not any(part.startswith(".") for part in k.split("/")))

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
            self._sidecar(path).unlink(missing_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot delete {path}: {exc}") from exc

    def open(self, key: str) -> BinaryIO:
        return open(self._verified(key), "rb")


def sweep_parts(dest: Path, began: float) -> None:
    """Remove the temp files an earlier write of `dest` left when it was killed (a SIGKILL runs no
    cleanup): those last written before this write began."""
    for part in dest.parent.glob(f".{dest.name}.*.part"):
        try:
            if part.stat().st_mtime < began:
                part.unlink()
        except OSError:
            continue  # gone meanwhile, or not ours to remove: it is only litter


def open_store(cfg: StoreConfig | str) -> ArtifactStore:
    """The store for a root URI: `s3://bucket/prefix` gives an S3Store, anything else a LocalStore."""
    if isinstance(cfg, str):
        cfg = StoreConfig(uri=cfg)
    if cfg.uri.startswith("s3://"):
        from aerie.s3store import S3Store

        return S3Store(cfg)
    return LocalStore(cfg.uri, mode=None if cfg.mode is None else int(cfg.mode, 8))


def _remedy(path: Path) -> str:
    """What to delete so that a re-run rewrites a corrupt object: the folder of the stage that wrote it
    (the nearest one above it holding a manifest; deleting the object alone leaves the stage's manifest,
    and the re-run takes the stage as done)."""
    for folder in path.parents:
        if (folder / "manifest.json").is_file():
            return f"delete {folder} (the stage that wrote it) and re-run: that stage runs again"
    return "delete it and re-run the stage that wrote it"
