"""Artifact stores: where every stage writes, addressed by keys under one root URI.

`LocalStore` (a directory, default `./artifacts`) and `S3Store` (boto3) share the `ArtifactStore`
protocol and one conformance suite (`tests/test_store.py`). Keys are `/`-separated relative paths
(`<run>/<stage>/<key>/file`); URIs are plain `str` (a `Path` would collapse the `//` of `s3://`).

Guarantees: an upload is atomic (a reader never sees a partial object); every object's sha256 is
recorded at upload and verified on download (`IntegrityError` on mismatch).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, runtime_checkable

from pydantic import Field

from aerie.configbase import StrictModel
from aerie.errors import IntegrityError, ObjectNotFoundError, StoreError

CHUNK = 8 << 20


class StoreConfig(StrictModel):
    """Where artifacts go: a local directory or `s3://bucket/prefix`."""

    uri: str = Field("./artifacts", description="Root: a local directory or s3://bucket/prefix.")
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint for MinIO/moto; None = AWS.")
    s3_region: str | None = Field(None, description="S3 region; None = boto3's default.")
    multipart_chunk_mb: int = Field(64, ge=5, description="Multipart upload part size (MiB).")
    max_concurrency: int = Field(8, ge=1, description="Parallel parts per transfer.")


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    uri: str
    size: int
    sha256: str


@runtime_checkable
class ArtifactStore(Protocol):
    root: str

    def uri(self, key: str) -> str: ...
    def put_file(self, key: str, path: str | Path) -> ObjectInfo: ...
    def put_bytes(self, key: str, data: bytes) -> ObjectInfo: ...
    def get_file(self, key: str, path: str | Path) -> Path: ...
    def get_bytes(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def open(self, key: str) -> BinaryIO: ...
    def local_path(self, key: str) -> Path | None:
        """A path readable in place (LocalStore), or None when the object must be downloaded."""
        ...


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _check_key(key: str) -> str:
    parts = key.strip("/").split("/")
    if not key or any(p in ("", ".", "..") for p in parts):
        raise StoreError(
            f"invalid artifact key {key!r}: use a relative path without '.', '..' or empty parts"
        )
    return "/".join(parts)


class LocalStore:
    """A directory. Objects are written to a temp file beside the target, fsync'd, then renamed;
    each object's sha256 sits in a hidden sidecar `.<name>.sha256` next to it."""

    def __init__(self, root: str | Path = "./artifacts") -> None:
        self._root = Path(root).expanduser().resolve()
        self.root = str(self._root)

    def _path(self, key: str) -> Path:
        return self._root / _check_key(key)

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
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        except OSError as exc:
            raise StoreError(f"cannot write {dest}: {exc}") from exc
        try:
            with os.fdopen(fd, "wb") as f:
                yield f, dest
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise StoreError(f"cannot write {dest}: {exc}") from exc
            raise

    def _record(self, key: str, dest: Path, digest: str) -> ObjectInfo:
        side = self._sidecar(dest)
        tmp = side.with_suffix(".tmp")
        tmp.write_text(digest)
        os.replace(tmp, side)
        return ObjectInfo(key=_check_key(key), uri=str(dest), size=dest.stat().st_size, sha256=digest)

    def put_file(self, key: str, path: str | Path) -> ObjectInfo:
        h = hashlib.sha256()
        try:
            src_f = open(path, "rb")  # noqa: SIM115 - closed by the with below; open errors need their own message
        except OSError as exc:
            raise StoreError(f"cannot read {path}: {exc}") from exc
        with src_f, self._atomic(key) as (f, dest):
            while block := src_f.read(CHUNK):
                h.update(block)
                f.write(block)
        return self._record(key, dest, h.hexdigest())

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        with self._atomic(key) as (f, dest):
            f.write(data)
        return self._record(key, dest, hashlib.sha256(data).hexdigest())

    def _verified(self, key: str) -> Path:
        path = self._path(key)
        if not path.is_file():
            raise ObjectNotFoundError(f"no artifact {key!r} in {self.root}")
        side = self._sidecar(path)
        if side.exists():
            want = side.read_text().strip()
            got = sha256_file(path)
            if got != want:
                raise IntegrityError(f"{path}: sha256 {got[:12]}… does not match the recorded {want[:12]}…")
        return path

    def get_file(self, key: str, path: str | Path) -> Path:
        src = self._verified(key)
        dest = Path(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if src.resolve() != dest.resolve():
            shutil.copyfile(src, dest)
        return dest

    def get_bytes(self, key: str) -> bytes:
        return self._verified(key).read_bytes()

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        base = self._root / prefix.strip("/") if prefix.strip("/") else self._root
        if not base.exists():
            return []
        files = [base] if base.is_file() else base.rglob("*")
        return sorted(
            p.relative_to(self._root).as_posix() for p in files if p.is_file() and not p.name.startswith(".")
        )

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        self._sidecar(path).unlink(missing_ok=True)

    def open(self, key: str) -> BinaryIO:
        return open(self._verified(key), "rb")


def open_store(cfg: StoreConfig | str) -> ArtifactStore:
    """The store for a root URI: `s3://bucket/prefix` gives an S3Store, anything else a LocalStore."""
    if isinstance(cfg, str):
        cfg = StoreConfig(uri=cfg)
    if cfg.uri.startswith("s3://"):
        from aerie.s3store import S3Store

        return S3Store(cfg)
    return LocalStore(cfg.uri)
