"""Where a slice's steady extraction time goes: the pump's critical path, its server's phases, and
what the commit path behind the pump was busy with.

The pump (`SliceWorker`, one per server) keeps `requests_in_flight` requests going and consumes the
replies in order, so its wall time is a chain of waits: on the oldest request, or on the commit
path; the rest is its own work (reading corpus rows, making batches, starting requests, the event
loop). Each wait on a request is attributed to the step that request was in meanwhile:

- `queued`: the request's task had not started yet (the event loop was busy elsewhere);
- `http_wait`: clearing stale dumps, then waiting for the `/generate` reply (the server's queue,
  forward, copy and dump writes, and the HTTP/JSON both ways);
- `dump_wait`: the reply came but the dump files were not visible yet;
- `read_dumps`: reading them back (and deleting them);
- `check`: checking them against the corpus rows and building the samples;

and `commit` is the time spent handing samples to the commit path (blocked while it is full) and
its final drain. So the client phases plus `other` (the remainder) are exactly the pump's wall.

The server's side is the reference server's `PhaseClock` (`/server_info` `internal_states[0]`
`extract_phases_s`), read when each pump starts and ends; its deltas cover the same windows. Servers
that do not report it (SGLang) leave `server` None. See `aerie.engine.server.scheduler.PhaseClock` for
what each server phase means; the dump writers' sums can exceed the wall (several threads).

`commit_path` says which part of the commit path (`aerie.extract.commit.ShardCommitter`, then the
stage's `Uploader`) bounds it when the pump waits in `commit`: seconds each part spent working or
blocked, summed over the slice's splits (one committer each) and pumps. They are busy times of other
threads, not parts of the pump's wall: their shares of it only say how loaded each thread was (near
1: that thread is saturated; `encode` and `upload` are sums over several threads and can exceed 1).

- `encode`: inside `ShardWriter.encode` (fp8 quantization or the bf16 cast), summed over the
  `commit_workers` encode threads (its share / commit_workers is the pool's utilisation);
- `append_wait_encode`: the append thread waiting for the encode tasks of the next sample in row
  order (a high share: the encode pool is behind);
- `append`: the append thread's own work (appending encoded rows to the open shard, sealing it, the
  `on_appended` progress callback), without the two waits;
- `write_slot_wait`: the append thread (and, once, the final drain) blocked because the previous
  shard is still being written (a high share: the write thread is the bound);
- `write`: the write thread inside `SealedShard.write_data` (preparing the layout, then
  `write_data`: the writev calls);
- `sync_slot_wait`: the write thread, its shard's data written, blocked because the previous shard is
  still being fsynced (a high share: the disk, not the writer, is the bound);
- `sync`: the sync thread inside `WrittenShard.sync`, of which `write_hash_wait` (waiting for the
  sha256 thread once the data is flushed and fsynced: hashing that outlasted writing) and
  `write_fsync` (flush, fsync and close of the temp file, rename, fsync of the directory);
- `on_closed`: the sync thread in the closed-shard callback after each shard: in the stage,
  handing the shard to the `Uploader`, which blocks while `max_pending` uploads wait (a high share:
  the uploads are the bound);
- `upload`: the `Uploader`'s threads (shared by this host's servers) in uploads during the pump's
  windows, summed over them (`adopt_file`: re-hash, rename into a local store / upload to S3, and
  the progress file update), uploads still running at a window's end counted up to it.

`commit_counts` has the shards written (`shards`, `shard_bytes`: write_data / shard_bytes is the
disk's rate) and `uploads` finished in the same windows. Records from before the group have neither.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

CLIENT_PHASES = ("queued", "http_wait", "dump_wait", "read_dumps", "check", "commit")
SERVER_PHASES_KEY = "extract_phases_s"
# The commit path's busy times (module docstring), in pipeline order: the committer's, the uploader's.
COMMITTER_STEPS = (
    "encode",
    "append_wait_encode",
    "append",
    "write_slot_wait",
    "write",
    "write_data",
    "sync_slot_wait",
    "sync",
    "write_hash_wait",
    "write_fsync",
    "on_closed",
)
COMMIT_PATH = (*COMMITTER_STEPS, "upload")
COMMIT_COUNTS = ("shards", "shard_bytes", "uploads")


@dataclass
class RequestTiming:
    """When one request reached each step (`time.monotonic()`; 0 = not reached yet)."""

    created: float = field(default_factory=time.monotonic)
    began: float = 0.0
    replied: float = 0.0
    dumps_found: float = 0.0
    read: float = 0.0
    done: float = 0.0

    def steps(self) -> list[tuple[str, float, float]]:
        """(phase, start, end) of each step reached so far."""
        marks = [self.created, self.began, self.replied, self.dumps_found, self.read, self.done]
        out = []
        for name, lo, hi in zip(CLIENT_PHASES[:-1], marks[:-1], marks[1:], strict=True):
            if not hi:
                break
            out.append((name, lo, hi))
        return out


@dataclass
class PhaseTotals:
    """A slice's phase seconds: the client's (summed over its pumps) and its server's (deltas)."""

    client: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CLIENT_PHASES, 0.0))
    server: dict[str, float] | None = None
    server_windows_missed: int = 0  # pumps whose server could not be read at both ends (it died)
    commit_path: dict[str, float] = field(default_factory=dict)  # seconds busy (module docstring)
    commit_counts: dict[str, int] = field(default_factory=dict)

    def waited_on(self, timing: RequestTiming, began: float, ended: float) -> None:
        """The pump waited from `began` to `ended` for the request `timing` describes."""
        for name, lo, hi in timing.steps():
            overlap = min(hi, ended) - max(lo, began)
            if overlap > 0:
                self.client[name] += overlap

    def committed(self, seconds: float) -> None:
        self.client["commit"] += seconds

    def commit_busy(self, seconds: dict[str, float], counts: dict[str, int] | None = None) -> None:
        """Add busy seconds (and counts) of the commit path's parts, e.g. one committer's `busy()`
        or the uploader's over one window."""
        for name, value in seconds.items():
            self.commit_path[name] = self.commit_path.get(name, 0.0) + value
        for name, n in (counts or {}).items():
            self.commit_counts[name] = self.commit_counts.get(name, 0) + n

    def server_window(self, before: dict[str, float] | None, after: dict[str, float] | None) -> None:
        """Add the server's phase deltas between two `/server_info` reads of one pump (None: it
        reported none, e.g. SGLang, or could not be read, e.g. it died mid-pump)."""
        if before is None or after is None:
            if before is not None or after is not None:
                self.server_windows_missed += 1
            return
        total = self.server if self.server is not None else {}
        for name, value in after.items():
            total[name] = total.get(name, 0.0) + value - before.get(name, 0.0)
        self.server = total

    def record(self) -> dict[str, Any]:
        """Plain seconds, for a slice record (`PhaseTotals.from_record` reads it back)."""
        return {
            "client": dict(self.client),
            "server": None if self.server is None else dict(self.server),
            "server_windows_missed": self.server_windows_missed,
            "commit_path": dict(self.commit_path),
            "commit_counts": dict(self.commit_counts),
        }

    @classmethod
    def from_record(cls, record: dict[str, Any] | None) -> PhaseTotals:
        if not record:
            return cls()
        return cls(
            client={**dict.fromkeys(CLIENT_PHASES, 0.0), **record.get("client", {})},
            server=record.get("server"),
            server_windows_missed=int(record.get("server_windows_missed", 0)),
            commit_path={k: float(v) for k, v in (record.get("commit_path") or {}).items()},
            commit_counts={k: int(v) for k, v in (record.get("commit_counts") or {}).items()},
        )

    def figures(self, wall: float) -> dict[str, Any]:
        """Seconds and shares of `wall` (the pump's steady time): client, server, commit path (None
        where not recorded). `client.other` is the pump's own time: the wall less the named client
        phases."""
        client = {**self.client, "other": wall - sum(self.client.values())}
        out: dict[str, Any] = {"wall_s": round(wall, 3), "client": _table(client, wall)}
        if self.server is None:
            out["server"] = None
        else:
            out["server"] = _table({k: v for k, v in self.server.items() if k != "wall"}, wall)
            # The server time the reads cover (the pumps' windows; less than the wall by the final drain).
            out["server_window_s"] = round(self.server.get("wall", 0.0), 3)
        if self.server_windows_missed:
            out["server_windows_missed"] = self.server_windows_missed
        steps = _ordered(self.commit_path, COMMIT_PATH)
        out["commit_path"] = _table(steps, wall) if steps else None
        if self.commit_counts:
            out["commit_counts"] = _ordered(self.commit_counts, COMMIT_COUNTS)
        return out


def _table(seconds: dict[str, float], wall: float) -> dict[str, dict[str, float]]:
    return {
        # Seconds to the microsecond: a step of a small slice can take well under a millisecond, and a
        # figure rounded to 0.0 would read as "never ran".
        name: {"s": round(v, 6), "share": round(v / wall, 3) if wall > 0 else 0.0}
        for name, v in seconds.items()
    }


def _ordered(values: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """`values` in the order of `names` (whatever order they were added in), unknown names last."""
    rank = {name: i for i, name in enumerate(names)}
    return dict(sorted(values.items(), key=lambda kv: rank.get(kv[0], len(rank))))
