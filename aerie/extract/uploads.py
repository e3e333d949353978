"""Background upload of closed shards, so extraction never waits on the store and local disk stays
bounded.

Each closed shard is uploaded by a worker thread; the upload is verified (the store's sha256 of what it
received equals the sha256 computed while the shard was written), recorded in `progress.json`. With
`delete_local` the store takes the file over (`adopt_file`: a rename into a local store, an upload
then delete for S3), so the shard is not written a second time. `submit` blocks while `max_pending` shards are still waiting, which is
what bounds the local disk when `delete_local_after_upload` is set (the preflight assumes it).

`busy()` is the seconds the worker threads have spent uploading (summed over them, so up to
`workers` times the wall), uploads still running counted up to now: the stage's pumps read it at
either end of their windows (`aerie.extract.phases`, `commit_path.upload`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from aerie.errors import IntegrityError, StoreError
from aerie.extract.resume import ClosedShard, ProgressFile
from aerie.shards.format import ShardInfo
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
        reread: bool = True,
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.progress = progress
        self.delete_local = delete_local
        self.reread = reread  # adopt_file's: False trusts the digest the shard writer computed
        self._slots = threading.BoundedSemaphore(max_pending)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="aerie-upload")
        self._futures: list[Future[ClosedShard]] = []
        self.uploaded_bytes = 0
        self._busy_lock = threading.Lock()
        self._busy_s = 0.0  # finished uploads (and failed attempts)
        self._uploads = 0
        self._running: dict[int, float] = {}  # thread id -> when its current upload began

    def busy(self) -> dict[str, float]:
        """Seconds the worker threads have spent in uploads so far, the running ones up to now."""
        with self._busy_lock:
            now = time.perf_counter()
            return {"upload": self._busy_s + sum(now - began for began in self._running.values())}

    def counts(self) -> dict[str, int]:
        """Uploads finished so far (a failed attempt counts)."""
        with self._busy_lock:
            return {"uploads": self._uploads}

    def submit(self, info: ShardInfo, shard: ClosedShard) -> None:
        self._slots.acquire()
        try:
            self._futures.append(self._pool.submit(self._upload, info, shard))
        except BaseException:
            self._slots.release()
            raise

    def _upload(self, info: ShardInfo, shard: ClosedShard) -> ClosedShard:
        me = threading.get_ident()
        with self._busy_lock:
            self._running[me] = time.perf_counter()
        try:
            key = f"{self.prefix}/{shard.path}"
            if self.delete_local:
                # The store takes the file over: a LocalStore on the same filesystem renames it (no
                # second write of every shard), an S3Store deletes it once the object is verified.
                # A file that no longer has the digest it was written with is refused, and kept
                # (unless `reread` is off and the store need not read it: `extract.reread_shards`).
                obj = self.store.adopt_file(key, info.path, sha256=info.sha256, reread=self.reread)
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
            with self._busy_lock:
                self._busy_s += time.perf_counter() - self._running.pop(me)
                self._uploads += 1
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
