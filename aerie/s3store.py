"""The S3 artifact store: `s3://bucket/prefix` through boto3, for AWS, MinIO or moto.

Same contract as `LocalStore` (`aerie/store.py`), checked by the same conformance suite:

- Uploads are atomic. A PUT, or the CompleteMultipartUpload that ends a multipart upload, makes the
  object appear whole or not at all. A multipart upload that fails (a network error, an exception
  raised by the caller's progress callback, Ctrl-C) is aborted, so no part lingers (and is billed).
  s3transfer aborts on failure; this store also aborts every upload id it saw created for the key, in
  case that abort was skipped. A process killed outright cannot abort: `abort_incomplete_uploads()`
  sweeps what such a process left (a bucket lifecycle rule does it on AWS).
- Every object carries its sha256 in its metadata (`x-amz-meta-sha256`). The digest has to be known
  when the upload starts (S3 metadata is fixed at CreateMultipartUpload), so `put_file` hashes the file
  first and checks, when the upload ends, that the file did not change meanwhile. Downloads are
  hashed and compared; a mismatch raises `IntegrityError` and never lands at the destination.
- `adopt_file` is put_file, then a HEAD that the stored object has the file's size and sha256, and
  only then the local file is deleted.
- botocore errors are translated into `StoreError`s that name the bucket and key and say what to fix.
  Credentials come from boto3's chain (env, profile, instance role) and never appear in a message.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast
from urllib.parse import urlsplit, urlunsplit

import boto3
from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.config import Config as BotoConfig
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    CredentialRetrievalError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from s3transfer.exceptions import RetriesExceededError, S3DownloadFailedError, S3UploadFailedError
from s3transfer.subscribers import BaseSubscriber

from aerie.diskspace import cannot_write
from aerie.errors import IntegrityError, ObjectNotFoundError, StoreError
from aerie.progress import ProgressFn
from aerie.store_api import (
    MIB,
    ByteProgress,
    ObjectInfo,
    StoreConfig,
    check_adopted,
    check_key,
    sha256_file,
    unlink_adopted,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from s3transfer.futures import TransferFuture
    from s3transfer.manager import TransferManager

log = logging.getLogger(__name__)

SHA256_META = "sha256"  # sent as the x-amz-meta-sha256 header
SPOOL_MAX = 64 * MIB  # open() keeps objects up to this size in memory, larger ones in a temp file
PROGRESS_INTERVAL_S = 0.2

_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
}
_DENIED_CODES = {"AccessDenied", "403", "Forbidden", "AllAccessDisabled"}
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}


# What `_errors` turns into StoreErrors (s3transfer raises a few of its own).
_TRANSLATED = (ClientError, BotoCoreError, RetriesExceededError, S3DownloadFailedError, S3UploadFailedError)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/a/b` -> ("bucket", "a/b"); the prefix may be empty."""
    parts = urlsplit(uri)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise StoreError(f"invalid store uri {uri!r}: expected s3://bucket or s3://bucket/prefix")
    prefix = parts.path.strip("/")
    return parts.netloc, check_key(prefix) if prefix else ""


def _redact(url: str | None) -> str:
    """An endpoint URL without any user:password@ part, fit for a message."""
    if not url:
        return "AWS S3 (default endpoint)"
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _status(exc: ClientError) -> int | None:
    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _is_key(rel: str) -> bool:
    try:
        return check_key(rel) == rel
    except StoreError:
        return False


class _Watch(BaseSubscriber):
    """Counts a transfer's bytes (in s3transfer's worker threads) and signals when it is over."""

    def __init__(self, meter: ByteProgress | None) -> None:
        self._meter = meter
        self.done = threading.Event()

    def on_progress(self, future: TransferFuture, bytes_transferred: int, **kwargs: Any) -> None:
        if self._meter:
            self._meter.add(bytes_transferred)

    def on_done(self, future: TransferFuture, **kwargs: Any) -> None:
        self.done.set()


def _wait(future: TransferFuture, watch: _Watch, meter: ByteProgress | None) -> None:
    """Wait for a transfer in the caller's thread, reporting progress from here: Ctrl-C and an
    exception raised by the progress callback land here, inside the TransferManager's `with`,
    which then cancels the transfer and aborts its multipart upload."""
    while not watch.done.wait(PROGRESS_INTERVAL_S):
        if meter:
            meter.report()
    future.result()
    if meter:
        meter.finish()


class _KnownObject(BaseSubscriber):
    """Hands s3transfer the size and ETag we already have from our HEAD, so it skips its own HEAD
    and pins every ranged GET to that ETag (IfMatch): the bytes we hash are the ones the recorded
    sha256 describes, even if someone overwrites the key mid-download."""

    def __init__(self, size: int, etag: str) -> None:
        self._size, self._etag = size, etag

    def on_queued(self, future: TransferFuture, **kwargs: Any) -> None:
        future.meta.provide_transfer_size(self._size)
        future.meta.provide_object_etag(self._etag)


class S3Store:
    """Artifacts under `s3://bucket/prefix`. Thread-safe: one boto3 client, shared by all calls."""

    def __init__(self, cfg: StoreConfig) -> None:
        self.bucket, self._prefix = parse_s3_uri(cfg.uri)
        self.root = f"s3://{self.bucket}/{self._prefix}" if self._prefix else f"s3://{self.bucket}"
        self._endpoint = _redact(cfg.s3_endpoint_url)
        chunk = cfg.multipart_chunk_mb * MIB
        self._threshold = chunk
        self._transfer = TransferConfig(
            multipart_threshold=chunk,
            multipart_chunksize=chunk,
            max_concurrency=cfg.max_concurrency,
            use_threads=True,
            preferred_transfer_client="classic",  # the CRT client is optional and behaves differently
        )
        boto_cfg = BotoConfig(
            # total_max_attempts counts the first try; botocore's "max_attempts" would count retries only.
            retries={"mode": "standard", "total_max_attempts": cfg.s3_max_attempts},
            connect_timeout=cfg.s3_connect_timeout_s,
            read_timeout=cfg.s3_read_timeout_s,
            max_pool_connections=max(10, cfg.max_concurrency + 2),
            # MinIO and moto serve buckets on a path, not as a subdomain of an IP address.
            s3={"addressing_style": "path"} if cfg.s3_endpoint_url else None,
        )
        # The first request goes through a client that gives up fast: an endpoint that cannot be
        # reached at all (a wrong URL, a server that is down) is reported in seconds, naming endpoint
        # and bucket. Once it answered, requests are patient: a blip mid-run is retried with backoff.
        self._probe_attempts = min(2, cfg.s3_max_attempts)
        probe_cfg = BotoConfig(
            retries={"mode": "standard", "total_max_attempts": self._probe_attempts},
            connect_timeout=min(cfg.s3_connect_timeout_s, cfg.s3_first_contact_timeout_s),
            read_timeout=min(cfg.s3_read_timeout_s, cfg.s3_first_contact_timeout_s),
            s3={"addressing_style": "path"} if cfg.s3_endpoint_url else None,
        )
        try:
            session = boto3.session.Session(region_name=cfg.s3_region)
            self.client: S3Client = session.client("s3", endpoint_url=cfg.s3_endpoint_url, config=boto_cfg)
            self._probe: S3Client = session.client("s3", endpoint_url=cfg.s3_endpoint_url, config=probe_cfg)
        except (BotoCoreError, ValueError) as exc:
            raise StoreError(
                f"cannot create an S3 client for {self.root} at {self._endpoint}: {type(exc).__name__}: "
                f"{exc}; check store.s3_endpoint_url and store.s3_region"
            ) from exc
        self._bucket_checked = False
        self._reached = False
        self._reach_lock = threading.Lock()
        # Upload ids this store created, per full key, so a failed upload can abort its own parts.
        self._uploads: dict[str, list[str]] = {}
        self._uploads_lock = threading.Lock()
        self.client.meta.events.register("after-call.s3.CreateMultipartUpload", self._note_multipart_upload)

    # -- keys and errors --------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        key = check_key(key)
        return f"{self._prefix}/{key}" if self._prefix else key

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._full(key)}"

    def local_path(self, key: str) -> Path | None:
        return None

    def _translate(self, exc: Exception, action: str, key: str | None) -> StoreError:
        """The StoreError that says what went wrong with which object, and what to fix."""
        where = self.uri(key) if key else self.root
        if isinstance(exc, RetriesExceededError) and isinstance(exc.last_exception, Exception):
            exc = exc.last_exception
        if isinstance(exc, S3DownloadFailedError | S3UploadFailedError):
            if isinstance(exc.__context__, ClientError | BotoCoreError):
                exc = exc.__context__
            elif "ETag" in str(exc):  # s3transfer's word for a PreconditionFailed ranged GET
                return StoreError(f"cannot {action} {where}: the object changed meanwhile; retry")
        if isinstance(exc, ClientError):
            code, status = _code(exc), _status(exc)
            message = exc.response.get("Error", {}).get("Message", "")
            if code in _NOT_FOUND_CODES:
                return ObjectNotFoundError(f"no artifact {where}")
            if code == "NoSuchBucket":
                return StoreError(
                    f"cannot {action} {where}: bucket {self.bucket!r} does not exist at {self._endpoint}; "
                    "create it or fix store.uri / store.s3_endpoint_url"
                )
            if code in _CREDENTIAL_CODES:
                return StoreError(
                    f"cannot {action} {where}: {self._endpoint} rejected the credentials ({code}); check "
                    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or AWS_PROFILE"
                )
            if code in _DENIED_CODES:
                return StoreError(
                    f"cannot {action} {where}: access denied ({code}); the credentials need s3:GetObject, "
                    f"s3:PutObject, s3:DeleteObject, s3:ListBucket and s3:AbortMultipartUpload on bucket "
                    f"{self.bucket!r}"
                )
            if code == "PreconditionFailed" or status == 412:
                return StoreError(f"cannot {action} {where}: the object changed meanwhile; retry")
            return StoreError(f"cannot {action} {where}: S3 error {code or '?'} (HTTP {status}): {message}")
        if isinstance(exc, NoCredentialsError | PartialCredentialsError | CredentialRetrievalError):
            return StoreError(
                f"cannot {action} {where}: no usable AWS credentials ({type(exc).__name__}); set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
            )
        if isinstance(exc, BotoConnectionError | HTTPClientError):  # refused, DNS, timeouts, dropped
            return StoreError(
                f"cannot {action} {where}: cannot reach the S3 endpoint {self._endpoint} "
                f"({type(exc).__name__}); check store.s3_endpoint_url, that the server is up, and the network"
            )
        return StoreError(f"cannot {action} {where}: {type(exc).__name__}: {exc}")

    def _first_contact(self, action: str, key: str | None) -> None:
        """Reach the endpoint once, fast (see `__init__`); raise a StoreError naming the endpoint and
        the bucket when it cannot be reached or the bucket does not exist."""
        if self._reached:
            return
        with self._reach_lock:
            if self._reached:
                return
            where = self.uri(key) if key else self.root
            began = time.monotonic()
            try:
                self._probe.head_bucket(Bucket=self.bucket)
                self._bucket_checked = True
            except ClientError as exc:
                if _status(exc) == 404 or _code(exc) == "NoSuchBucket":
                    raise StoreError(
                        f"cannot {action} {where}: bucket {self.bucket!r} does not exist at "
                        f"{self._endpoint}; create it or fix store.uri / store.s3_endpoint_url"
                    ) from exc
                # 403 and the like: it answered; a policy may allow objects but not HeadBucket.
            except (BotoConnectionError, HTTPClientError) as exc:  # refused, DNS, timeouts, dropped
                raise StoreError(
                    f"cannot {action} {where}: cannot reach the S3 endpoint {self._endpoint} for bucket "
                    f"{self.bucket!r} ({type(exc).__name__}, {self._probe_attempts} attempt(s) in "
                    f"{time.monotonic() - began:.1f} s); check store.s3_endpoint_url, that the server "
                    "is up, and the network"
                ) from exc
            except BotoCoreError as exc:
                raise self._translate(exc, action, key) from exc
            self._reached = True

    @contextmanager
    def _errors(self, action: str, key: str | None = None) -> Iterator[None]:
        self._first_contact(action, key)
        try:
            yield
        except _TRANSLATED as exc:
            raise self._translate(exc, action, key) from exc

    def _check_bucket(self, action: str, key: str) -> None:
        """HEAD answers 404 without a body for a missing key *and* a missing bucket; tell them apart
        once, so a misspelt bucket is an error instead of 'nothing cached yet'."""
        if self._bucket_checked:
            return
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            if _status(exc) == 404:
                raise StoreError(
                    f"cannot {action} {self.uri(key)}: bucket {self.bucket!r} does not exist at "
                    f"{self._endpoint}; create it or fix store.uri / store.s3_endpoint_url"
                ) from exc
            # 403 and the like: a policy may allow objects but not HeadBucket; carry on.
        except BotoCoreError as exc:
            raise self._translate(exc, action, key) from exc
        self._bucket_checked = True

    def _head(self, key: str, action: str) -> dict[str, Any] | None:
        """head_object's answer, or None when there is no such object."""
        self._first_contact(action, key)
        try:
            return cast("dict[str, Any]", self.client.head_object(Bucket=self.bucket, Key=self._full(key)))
        except ClientError as exc:
            if _status(exc) == 404:
                self._check_bucket(action, key)
                return None
            raise self._translate(exc, action, key) from exc
        except BotoCoreError as exc:
            raise self._translate(exc, action, key) from exc

    # -- uploads ----------------------------------------------------------------------------------

    def _note_multipart_upload(self, parsed: dict[str, Any], **kwargs: Any) -> None:
        if parsed.get("Bucket") == self.bucket and "UploadId" in parsed and "Key" in parsed:
            with self._uploads_lock:
                self._uploads.setdefault(parsed["Key"], []).append(parsed["UploadId"])

    def _abort_leftovers(self, full: str, failed: bool) -> None:
        """Forget the upload ids noted for `full`; after a failure, abort any that are still open."""
        with self._uploads_lock:
            ids = self._uploads.pop(full, [])
        for upload_id in ids if failed else []:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            except ClientError as exc:
                if _code(exc) != "NoSuchUpload":  # NoSuchUpload: s3transfer already aborted it
                    log.warning("could not abort multipart upload of s3://%s/%s: %s", self.bucket, full, exc)
            except BotoCoreError as exc:
                log.warning("could not abort multipart upload of s3://%s/%s: %s", self.bucket, full, exc)

    def _upload(self, key: str, source: str | BinaryIO, digest: str, meter: ByteProgress | None) -> None:
        full = self._full(key)
        watch = _Watch(meter)
        failed = True
        try:
            # The manager's __exit__ cancels the transfer on any exception (Ctrl-C included) and
            # waits for its cleanups, which abort the multipart upload.
            with self._errors("upload to", key), self._manager() as manager:
                future = manager.upload(
                    source,
                    self.bucket,
                    full,
                    extra_args={"Metadata": {SHA256_META: digest}},
                    subscribers=[watch],
                )
                _wait(future, watch, meter)
            failed = False
        finally:
            self._abort_leftovers(full, failed)

    def _manager(self) -> TransferManager:
        return cast("TransferManager", create_transfer_manager(self.client, self._transfer))

    def put_file(self, key: str, path: str | Path, *, progress: ProgressFn | None = None) -> ObjectInfo:
        return self._put_file(key, path, progress, want=None)

    def _put_file(
        self, key: str, path: str | Path, progress: ProgressFn | None, want: str | None
    ) -> ObjectInfo:
        """Hash, refuse a digest other than `want` (when given) before anything is sent, upload."""
        key, src = check_key(key), Path(path)
        try:
            before = src.stat()
            digest = sha256_file(src)
        except OSError as exc:
            raise StoreError(f"cannot read {src}: {exc}") from exc
        check_adopted(src, want, digest)
        meter = ByteProgress(progress, before.st_size, f"upload {key}") if progress else None
        self._upload(key, str(src), digest, meter)
        after = src.stat()
        if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
            # The object holds bytes the recorded digest may not describe: take it away.
            self.delete(key)
            raise StoreError(
                f"{src} changed while it was uploaded to {self.uri(key)}; the object was removed, "
                "upload it again once the file is complete"
            )
        return ObjectInfo(key=key, uri=self.uri(key), size=before.st_size, sha256=digest)

    def adopt_file(
        self, key: str, path: str | Path, *, sha256: str | None = None, reread: bool = True
    ) -> ObjectInfo:
        del reread  # an upload reads the file whatever the caller says, and checks it against `sha256`
        info = self._put_file(key, path, None, want=sha256)
        # The local file may be the only other copy: delete it only once S3 holds what we hashed.
        head = self._head(info.key, "verify")
        stored = (int(head["ContentLength"]), head.get("Metadata", {}).get(SHA256_META)) if head else None
        if stored != (info.size, info.sha256):
            raise IntegrityError(
                f"{info.uri} does not hold {path} after its upload (size and sha256 {stored}, expected "
                f"{(info.size, info.sha256)}); {path} was kept, upload it again"
            )
        unlink_adopted(Path(path), info.uri)
        return info

    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        key = check_key(key)
        digest = hashlib.sha256(data).hexdigest()
        if len(data) >= self._threshold:
            self._upload(key, io.BytesIO(data), digest, None)
        else:
            with self._errors("upload to", key):
                self.client.put_object(
                    Bucket=self.bucket, Key=self._full(key), Body=data, Metadata={SHA256_META: digest}
                )
        return ObjectInfo(key=key, uri=self.uri(key), size=len(data), sha256=digest)

    def abort_incomplete_uploads(self, prefix: str = "", older_than_s: float = 24 * 3600) -> int:
        """Abort multipart uploads under `prefix` started more than `older_than_s` ago: what a killed
        process leaves behind (invisible, but billed). Returns how many were aborted."""
        base = self._full(prefix) if prefix.strip("/") else self._prefix
        cutoff = time.time() - older_than_s
        aborted = 0
        with self._errors("list multipart uploads under", prefix or None):
            paginator = self.client.get_paginator("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=f"{base}/" if base else ""):
                for upload in page.get("Uploads", []):
                    if upload["Initiated"].timestamp() <= cutoff:
                        self.client.abort_multipart_upload(
                            Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                        aborted += 1
        return aborted

    # -- downloads --------------------------------------------------------------------------------

    def _verify(self, key: str, want: str | None, got: str) -> None:
        # An object without the metadata was not written by aerie: there is nothing to compare with.
        if want is not None and got != want:
            raise IntegrityError(
                f"{self.uri(key)}: downloaded sha256 {got[:12]}… does not match the recorded "
                f"{want[:12]}…; the object is corrupt: delete it and re-run the stage that wrote it"
            )

    def get_file(self, key: str, path: str | Path, *, progress: ProgressFn | None = None) -> Path:
        key, dest = check_key(key), Path(path)
        head = self._head(key, "download")
        if head is None:
            raise ObjectNotFoundError(f"no artifact {self.uri(key)}")
        size = int(head["ContentLength"])
        want = head.get("Metadata", {}).get(SHA256_META)
        meter = ByteProgress(progress, size, f"download {key}") if progress else None
        watch = _Watch(meter)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
            os.close(fd)
        except OSError as exc:
            raise StoreError(cannot_write(dest, exc)) from exc
        try:
            with self._errors("download", key), self._manager() as manager:
                subscribers = [_KnownObject(size, head["ETag"]), watch]
                future = manager.download(self.bucket, self._full(key), tmp, subscribers=subscribers)
                _wait(future, watch, meter)
            self._verify(key, want, sha256_file(tmp))
            os.replace(tmp, dest)
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise StoreError(cannot_write(dest, exc)) from exc
            raise
        return dest

    def _stream(self, key: str, out: BinaryIO) -> None:
        """GET the object into `out`, hashing as it streams, and verify."""
        with self._errors("download", key):
            response = self.client.get_object(Bucket=self.bucket, Key=self._full(key))
            h = hashlib.sha256()
            for block in response["Body"].iter_chunks(chunk_size=1 * MIB):
                h.update(block)
                out.write(block)
        self._verify(key, response.get("Metadata", {}).get(SHA256_META), h.hexdigest())

    def get_bytes(self, key: str) -> bytes:
        buf = io.BytesIO()
        self._stream(key, buf)
        return buf.getvalue()

    def open(self, key: str) -> BinaryIO:
        """A verified read-only copy: in memory up to 64 MiB, in an anonymous temp file beyond."""
        spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_MAX)  # noqa: SIM115 - returned to the caller
        try:
            self._stream(key, cast(BinaryIO, spool))
        except BaseException:
            spool.close()
            raise
        spool.seek(0)
        return cast(BinaryIO, spool)

    # -- listing ----------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self._head(key, "check") is not None

    def list(self, prefix: str = "") -> list[str]:
        """Keys under `prefix` taken as a directory (`a/b` lists `a/b/...` and `a/b` itself, never
        `a/bc`), relative to the store's root, sorted."""
        sub = check_key(prefix) if prefix.strip("/") else ""
        base = self._full(sub) if sub else self._prefix
        strip = len(self._prefix) + 1 if self._prefix else 0
        keys: list[str] = []
        with self._errors("list", sub or None):
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base):
                for obj in page.get("Contents", []):
                    full = obj["Key"]
                    if base and not (full == base or full.startswith(f"{base}/")):
                        continue
                    rel = full[strip:]
                    # Skip what a valid key can never be ("dir/" markers from consoles, dotfiles).
                    if _is_key(rel):
                        keys.append(rel)
        return sorted(keys)

    def delete(self, key: str) -> None:
        with self._errors("delete", key):
            self.client.delete_object(Bucket=self.bucket, Key=self._full(key))
