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
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, runtime_checkable

from pydantic import Field

from aerie.configbase import StrictModel
from aerie.diskspace import cannot_write, free_text
from aerie.errors import IntegrityError, ObjectNotFoundError, StoreError
from aerie.progress import ProgressFn

CHUNK = 8 << 20
MIB = 1 << 20


class StoreConfig(StrictModel):
    """Where artifacts go: a local directory or `s3://bucket/prefix`."""

    uri: str = Field("./artifacts", description="Root: a local directory or s3://bucket/prefix.")
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint for MinIO/moto; None = AWS.")
    s3_region: str | None = Field(None, description="S3 region; None = boto3's default.")
    multipart_chunk_mb: int = Field(64, ge=5, description="Multipart upload part size (MiB).")
    max_concurrency: int = Field(8, ge=1, description="Parallel parts per transfer.")
    s3_max_attempts: int = Field(
        10, ge=1, description="Attempts per S3 request (botocore 'standard' retries, with backoff)."
    )
    s3_connect_timeout_s: float = Field(10.0, gt=0, description="S3 connect timeout (seconds).")
    s3_read_timeout_s: float = Field(60.0, gt=0, description="S3 read timeout per request (seconds).")


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
    def put_file(self, key: str, path: str | Path, *, progress: ProgressFn | None = None) -> ObjectInfo:
        """Upload a file atomically. `progress` gets (fraction, message) as bytes go out, always in the
        caller's thread; an exception it raises mid-transfer cancels the upload and leaves nothing."""
        ...

    def adopt_file(
        self, key: str, path: str | Path, *, sha256: str | None = None, reread: bool = True
    ) -> ObjectInfo:
        """Upload a finished file and take it over: on success `path` is gone (moved in, or deleted
        once the stored copy is verified). `sha256` is the digest the caller computed while writing
        it: a file that no longer matches raises `IntegrityError`, and then nothing is stored and
        `path` stays. The caller must not write to `path` any more.

        `reread=False` (with `sha256`): where the store can take the file without reading it (a
        LocalStore on the same filesystem renames it), it records `sha256` instead of reading the file
        back, for a writer that hashed the very bytes it wrote and fsynced: a read-back costs a
        disk-bound writer the bandwidth it needs. An upload reads the file anyway, and verifies it."""
        ...

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo: ...
    def get_file(self, key: str, path: str | Path, *, progress: ProgressFn | None = None) -> Path:
        """Download to `path`, verified: a corrupt object raises `IntegrityError` and `path` is not
        touched (the bytes land in a temp file beside it and are renamed only once verified)."""
        ...

    def get_bytes(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def open(self, key: str) -> BinaryIO: ...
    def local_path(self, key: str) -> Path | None:
        """A path readable in place (LocalStore), or None when the object must be downloaded."""
        ...


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return _sha256_of(f)


def _sha256_of(f: BinaryIO) -> str:
    h = hashlib.sha256()
    while block := f.read(CHUNK):
        h.update(block)
    return h.hexdigest()


def check_adopted(path: str | Path, want: str | None, got: str) -> None:
    """IntegrityError when a file handed to `adopt_file` is not the one its writer hashed."""
    if want is not None and got != want:
        raise IntegrityError(
            f"{path}: sha256 {got[:12]}… is not the {want[:12]}… it was written with; the file is "
            "corrupt or was changed after it was written, and was not stored"
        )


class ByteProgress:
    """Counts transferred bytes from any thread; reports throttled `(fraction, message)` calls from the
    caller's thread only.

    Why split: s3transfer counts bytes in its worker threads, but the callback may update a Prefect
    progress artifact (which needs the flow run's context, held by the calling thread) or raise to
    cancel the transfer (which, raised inside botocore's send, would be retried as a network error).
    And a call happens only when the fraction moved by `step`, not for every 256 KiB read."""

    def __init__(self, progress: ProgressFn, total: int, label: str, step: float = 0.01) -> None:
        self._progress, self._total, self._label, self._step = progress, total, label, step
        self._done = 0
        self._last = -1.0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        """Count bytes (any thread). s3transfer reports negative counts when it rewinds for a retry."""
        with self._lock:
            self._done += nbytes

    def report(self) -> None:
        """Call the callback if the fraction moved enough (the caller's thread; may raise)."""
        with self._lock:
            done = self._done
        fraction = min(1.0, max(0.0, done / self._total)) if self._total else 1.0
        if fraction - self._last >= self._step or (fraction >= 1.0 > self._last):
            self._last = fraction
            self._progress(fraction, f"{self._label} {done / MIB:.1f}/{self._total / MIB:.1f} MiB")

    def finish(self) -> None:
        """Report completion even when the transfer reported no bytes (an empty file)."""
        if self._last < 1.0:
            self._last = 1.0
            self._progress(1.0, f"{self._label} {self._total / MIB:.1f} MiB")


def check_key(key: str) -> str:
    """The normalized key, or StoreError. Parts starting with '.' are refused: a store keeps its temp
    files and checksum sidecars under such names, and `list()` must never show them."""
    parts = key.strip("/").split("/")
    if not key.strip("/") or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
        raise StoreError(
            f"invalid artifact key {key!r}: use a relative '/'-separated path without empty parts "
            "or parts starting with '.'"
        )
    return "/".join(parts)


class LocalStore:
    """A directory. Objects are written to a temp file beside the target, fsync'd, then renamed;
    each object's sha256 sits in a hidden sidecar `.<name>.sha256` next to it."""

    def __init__(self, root: str | Path = "./artifacts") -> None:
        self._root = Path(root).expanduser().resolve()
        self.root = str(self._root)

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
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
        except OSError as exc:
            raise StoreError(cannot_write(dest, exc)) from exc
        try:
            with os.fdopen(fd, "wb") as f:
                yield f, dest
                f.flush()
                os.fsync(f.fileno())
            # The old sidecar goes first: a crash before the new one is written leaves an object that
            # is unverified, never one that fails verification against the previous object's digest.
            self._sidecar(dest).unlink(missing_ok=True)
            os.replace(tmp, dest)
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
                    digest = _sha256_of(f)
                    os.fsync(f.fileno())  # put_file's temp file is fsync'd before its rename: the same here
            except OSError as exc:
                raise StoreError(f"cannot read {src}: {exc}") from exc
            check_adopted(src, sha256, digest)
        else:
            digest = sha256
        if src.resolve() == dest.resolve():  # already in place (written straight into the store)
            return self._record(key, dest, digest)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            # The old sidecar goes first, as in _atomic: a crash in between leaves an unverified
            # object, never one checked against the previous object's digest.
            self._sidecar(dest).unlink(missing_ok=True)
            os.replace(src, dest)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise StoreError(f"cannot move {src} to {dest}: {exc}") from exc
            info = self._copy_in(key, src, None, want=digest)
            unlink_adopted(src, info.uri)
            return info
        return self._record(key, dest, digest)

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
                "corrupt: delete it and re-run the stage that wrote it"
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
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
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


def unlink_adopted(path: Path, uri: str) -> None:
    """Delete a file that is now stored (and verified) at `uri`."""
    try:
        path.unlink()
    except OSError as exc:
        raise StoreError(f"{path} is stored as {uri} but could not be deleted: {exc}") from exc


def open_store(cfg: StoreConfig | str) -> ArtifactStore:
    """The store for a root URI: `s3://bucket/prefix` gives an S3Store, anything else a LocalStore."""
    if isinstance(cfg, str):
        cfg = StoreConfig(uri=cfg)
    if cfg.uri.startswith("s3://"):
        from aerie.s3store import S3Store

        return S3Store(cfg)
    return LocalStore(cfg.uri)
