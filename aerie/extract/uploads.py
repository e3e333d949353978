"""Background upload of closed shards, so extraction never waits on the store and local disk stays
bounded.

Each closed shard is uploaded by a worker thread; the upload is verified (the store's sha256 of what it
received equals the sha256 computed while the shard was written), recorded in `progress.json`. With
`delete_local` the store takes the file over (`adopt_file`: a rename into a local store, an upload
then delete for S3), so the shard is not written a second time. `submit` blocks while `max_pending` shards are still waiting, which is
what bounds the local disk when `delete_local_after_upload` is set (the preflight assumes it).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from aerie.errors import IntegrityError, StoreError
from aerie.extract.resume import ClosedShard, ProgressFile
from aerie.extract.shards import ShardInfo
from aerie.store import ArtifactStore

log = logging.getLogger(__name__)


class Uploader:
    def __init__(
        self,
        store: ArtifactStore,
        prefix: str,
        progress: ProgressFile,
        *,
        delete_local: bool,
        max_pending: int = 2,
        workers: int = 2,
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.progress = progress
        self.delete_local = delete_local
        self._slots = threading.BoundedSemaphore(max_pending)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="aerie-upload")
        self._futures: list[Future[ClosedShard]] = []
        self.uploaded_bytes = 0

    def submit(self, info: ShardInfo, shard: ClosedShard) -> None:
        self._slots.acquire()
        try:
            self._futures.append(self._pool.submit(self._upload, info, shard))
        except BaseException:
            self._slots.release()
            raise

    def _upload(self, info: ShardInfo, shard: ClosedShard) -> ClosedShard:
        try:
            key = f"{self.prefix}/{shard.path}"
            if self.delete_local:
                # The store takes the file over: a LocalStore on the same filesystem renames it (no
                # second write of every shard), an S3Store deletes it once the object is verified.
                # A file that no longer has the digest it was written with is refused, and kept.
                obj = self.store.adopt_file(key, info.path, sha256=info.sha256)
            else:
                obj = self.store.put_file(key, info.path)
            if obj.sha256 != info.sha256 or obj.size != info.bytes:
                raise IntegrityError(
                    f"upload of {info.path} to {obj.uri} is corrupt: store has {obj.size} bytes sha256 "
                    f"{obj.sha256[:12]}…, the shard was written with {info.bytes} bytes sha256 {info.sha256[:12]}…"
                )
            self.progress.add(shard)
            self.uploaded_bytes += info.bytes
            log.info("uploaded %s (%d samples, %d tokens)", obj.uri, shard.samples, shard.tokens)
            return shard
        finally:
            self._slots.release()

    def wait(self) -> list[ClosedShard]:
        """Block until every submitted upload is done; re-raise the first failure."""
        done: list[ClosedShard] = []
        first: BaseException | None = None
        for fut in self._futures:
            try:
                done.append(fut.result())
            except BaseException as exc:
                first = first or exc
        self._futures = []
        if first is not None:
            if isinstance(first, StoreError):
                raise first
            raise StoreError(f"shard upload failed: {type(first).__name__}: {first}") from first
        return done

    def close(self) -> None:
        self._pool.shutdown(wait=True)
