"""The artifact-store contract: what every backend implements and shares.

`ArtifactStore` (the protocol), `StoreConfig`, `ObjectInfo`, the key rules, hashing and byte-progress
helpers. `aerie.store` (LocalStore, `open_store`) and `aerie.s3store` (S3Store) both build on this
module and neither imports the other at module level, so the two backends stay free of a cycle.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, runtime_checkable

from pydantic import Field, model_validator

from aerie.configbase import StrictModel
from aerie.errors import IntegrityError, StoreError
from aerie.progress import ProgressFn

CHUNK = 8 << 20
MIB = 1 << 20


class StoreConfig(StrictModel):
    """Where artifacts go: a local directory or `s3://bucket/prefix`."""

    uri: str = Field(
        "./artifacts",
        pattern=r"\S",
        description="Root: a local directory or s3://bucket/prefix (an empty one is refused: it would "
        "write into whatever directory the command runs in).",
    )
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint for MinIO/moto; None = AWS.")
    s3_region: str | None = Field(None, description="S3 region; None = boto3's default.")
    multipart_chunk_mb: int = Field(64, ge=5, description="Multipart upload part size (MiB).")
    max_concurrency: int = Field(8, ge=1, description="Parallel parts per transfer.")
    s3_max_attempts: int = Field(
        10, ge=1, description="Attempts per S3 request (botocore 'standard' retries, with backoff)."
    )
    s3_connect_timeout_s: float = Field(10.0, gt=0, description="S3 connect timeout (seconds).")
    s3_read_timeout_s: float = Field(60.0, gt=0, description="S3 read timeout per request (seconds).")
    s3_first_contact_timeout_s: float = Field(
        5.0,
        gt=0,
        description="Connect and read timeout of the store's first request (2 attempts at most), so an "
        "unreachable endpoint fails in seconds instead of after every patient retry.",
    )

    mode: str | None = Field(
        None,
        pattern=r"^0?[0-7]{3}$",
        description="A local store's file permissions, octal (e.g. '0640': the group reads what the "
        "run writes); its directories get the same plus search (x) where read is given. None = what "
        "the umask allows, as any file a program writes (0644 under the usual umask 022).",
    )

    @model_validator(mode="after")
    def _mode_is_for_a_local_store(self) -> StoreConfig:
        if self.mode is not None and self.uri.startswith("s3://"):
            raise ValueError(
                f"mode {self.mode!r} sets a local store's file permissions; who reads {self.uri} is "
                "the bucket's policy"
            )
        return self


def current_umask() -> int:
    """This process's umask, read without changing it (Linux: /proc); elsewhere set and restored."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        old = os.umask(0o022)
        os.umask(old)
    return old


_UMASK_LOCK = threading.Lock()


def file_mode(mode: int | None = None) -> int:
    """The permissions of a new file: `mode` when given, else what `open()` would give (0666 minus the
    umask). Temp files are created 0600 whatever the umask: renamed into place, they need this."""
    return mode if mode is not None else 0o666 & ~current_umask()


def dir_mode(mode: int) -> int:
    """A directory holding files of `mode`: the same, plus search (x) wherever read (r) is given."""
    return mode | ((mode & 0o444) >> 2)


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
        return sha256_of(f)


def sha256_of(f: BinaryIO) -> str:
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


def unlink_adopted(path: Path, uri: str) -> None:
    """Delete a file that is now stored (and verified) at `uri`."""
    try:
        path.unlink()
    except OSError as exc:
        raise StoreError(f"{path} is stored as {uri} but could not be deleted: {exc}") from exc
