"""Online training: the train stage's own extraction servers feed the trainer; no shards are written.

    OnlineFeeder(spec, cfg, target, dist, emit)      one per trainer process (each data-parallel rank)
      .index(split) -> SampleIndex                   the split's samples: corpus rows, their lengths
      .batches(plans, first, stride, count)          packed rows, exactly those the shard path yields
      .close()                                       the servers torn down

The servers are the extract stage's: the same launch (`aerie.extract.fleet.server_spec`: reference
server or SGLang, process or container, the backend's capture flags and dump plugin), readiness and
nonce (`aerie.serving.ModelServer`), canary (`aerie.extract.fleet.make_canary`) and request path
(`aerie.extract.client.ExtractionClient`: dumps checked against the corpus rows). What the shards would
hold is what the trainer gets: each sample is encoded by the shard writer's own `encode` (bf16, or fp8
codes with per-token scales), so an online run and an offline run with the same seed consume the same
values in the same order and train the same drafter.

The order is the shard path's: the epoch plan (`aerie.train.data.plan_epoch`) is a function of the
sample lengths and the training seed, and the shards hold the corpus rows in corpus order, so sample `i` here is
corpus row `i` of its split. For the rows the trainer will take next, the look-ahead (`_LookAhead`,
running on the loader's background thread while the trainer steps) requests their samples from the
servers in requests of up to `extract.batch_tokens` tokens, holding at most
`train.online.buffer_tokens` tokens of samples requested and not yet consumed (one sample at least):
memory stays flat whatever the corpus size. A sample cut across two rows is extracted once.

Each server has `extract.requests_in_flight` threads taking requests from one queue, so several
servers feed one trainer and a slow one takes fewer. A server that fails mid-request (it died, or it
stopped answering) is restarted (up to `extract.max_restarts` times per server) and the request is
sent again whole: the trainer waits for exactly the samples it asked for, none lost, none twice.
A data-parallel rank has its own feeder and its own servers (`rank_servers`), and extracts only the
rows of its own batches (rank r takes global batches r, r+W, ...).

The corpus's token ids and loss masks are held in memory (a few bytes a token, against the
`8 x hidden` bytes a token of hidden states that are never held beyond the buffer). An optional local
cache (`train.online.cache_bytes`) keeps encoded samples on disk, filled until full, and reads them
instead of extracting again in later epochs and evaluations.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from pydantic import BaseModel
from safetensors.torch import load_file, save_file

from aerie.errors import ExtractionError, ServerError, TrainingError
from aerie.extract.client import Batch as Request
from aerie.extract.client import ExtractionClient, ServerUnavailable
from aerie.extract.config import ExtractConfig
from aerie.extract.corpus_rows import Row, SplitFiles
from aerie.extract.fleet import make_canary, server_spec
from aerie.serving import ModelServer, ServerConfig
from aerie.serving.restarts import ServerSlot
from aerie.shards.format import HiddenSample
from aerie.shards.writer import ShardWriter
from aerie.targets import TargetInfo
from aerie.train.config import TrainConfig
from aerie.train.data import Batch, BatchReader, EpochPlans, Piece, SampleIndex
from aerie.train.distributed import DistInfo

log = logging.getLogger(__name__)

Emit = Callable[[dict[str, Any]], None]
Features = dict[str, torch.Tensor]  # one sample as `ShardReader.token_slice(..., dequantize=False)` gives it


class SplitSpec(BaseModel):
    """One corpus split's parquet files (local paths, in corpus order) and their row counts."""

    paths: list[str]
    rows: list[int]
    tokens: int

    def files(self, split: str) -> SplitFiles:
        return SplitFiles(
            split=split, paths=[Path(p) for p in self.paths], rows=self.rows, tokens=self.tokens
        )


class OnlineSpec(BaseModel):
    """What a trainer process needs to run its own extraction servers (JSON: torchrun workers read it)."""

    extract: ExtractConfig
    server: ServerConfig
    splits: dict[str, SplitSpec]  # the extracted splits, in `extract.splits` order
    dump_root: str
    log_dir: str
    cache_dir: str
    train_gpus: int = 1  # GPUs the trainer itself uses: servers go on the ones after them


# --------------------------------------------------------------------------------------- sharding


def rank_servers(num_servers: int, rank: int) -> range:
    """Global indices of the servers data-parallel rank `rank` runs (its ports: server.port + index)."""
    return range(rank * num_servers, (rank + 1) * num_servers)


def server_gpus(train_gpus: int, index: int, tp_size: int) -> str:
    """`CUDA_VISIBLE_DEVICES` of server `index` on a host whose first `train_gpus` GPUs train."""
    first = train_gpus + index * tp_size
    return ",".join(str(first + i) for i in range(tp_size))


def rank_batches(first: int, stride: int, count: int) -> list[int]:
    """The global batch indices a rank takes: first, first + stride, ... (the loop's `batch_stream`)."""
    return [first + i * stride for i in range(count)]


# --------------------------------------------------------------------------------------- the corpus


class RowTable:
    """A split's rows by index: ids and masks in memory (polars lists), read once."""

    def __init__(self, files: SplitFiles) -> None:
        frames = [
            pl.read_parquet(p, columns=["id", "input_ids", "loss_mask"]) for p in files.paths if files.rows
        ]
        self.frame = pl.concat(frames) if frames else pl.DataFrame()
        self.split = files.split
        if self.frame.height != files.total_rows:
            raise TrainingError(
                f"corpus split {files.split}: its files hold {self.frame.height} rows, the manifest says "
                f"{files.total_rows}"
            )
        self.lengths = (
            self.frame["input_ids"].list.len().to_numpy().astype(np.int64)
            if self.frame.height
            else np.zeros(0, dtype=np.int64)
        )

    def row(self, i: int) -> Row:
        sid, ids, mask = self.frame.row(i)
        return Row(index=i, id=str(sid), input_ids=list(ids), loss_mask=list(mask))


# --------------------------------------------------------------------------------------- the servers


@dataclass
class _Job:
    split: str
    rows: list[Row]
    number: int
    future: Future[list[Features]] = field(default_factory=Future)

    @property
    def tokens(self) -> int:
        return sum(len(r.input_ids) for r in self.rows)


@dataclass
class ServerStats:
    """What one server extracted, for the manifest and the progress (its starts and restarts are its
    slot's). `requests_in_flight` threads count at once, hence the lock."""

    index: int
    backend: str = ""
    address: str = ""  # the server's URL, known once launched
    requests: int = 0
    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def served(self, tokens: int) -> None:
        with self.lock:
            self.requests += 1
            self.tokens += tokens

    def record(self, slot: ServerSlot) -> dict[str, Any]:
        with self.lock:
            return {
                "server": f"s{self.index}",
                "backend": self.backend,
                "address": self.address,
                **slot.record(),
                "requests": self.requests,
                "tokens": self.tokens,
            }


class ServerPool:
    """A rank's extraction servers, `requests_in_flight` threads each, taking jobs from one queue."""

    def __init__(
        self, spec: OnlineSpec, target: TargetInfo, servers: range, splits: dict[str, SplitFiles], say: Emit
    ) -> None:
        self.spec, self.cfg, self.target = spec, spec.extract, target
        self._say = say
        self.canary = make_canary(spec.extract, target, splits)
        self.stats = {k: ServerStats(k, backend=spec.server.backend) for k in servers}
        self.slots = [self._slot(k) for k in servers]
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.closed = threading.Event()
        self.threads = [
            threading.Thread(target=self._work, args=(k, slot), name=f"aerie-online-s{k}-{i}", daemon=True)
            for k, slot in zip(servers, self.slots, strict=True)
            for i in range(self.cfg.requests_in_flight)
        ]
        for t in self.threads:
            t.start()

    def say(self, message: str) -> None:
        self._say({"kind": "server", "message": message})

    def _slot(self, k: int) -> ServerSlot:
        def exhausted(why: str) -> ExtractionError:
            return ExtractionError(
                f"online training: server s{k} failed and extract.max_restarts={self.cfg.max_restarts} is "
                f"used up; checkpoints so far are in the store and a re-run resumes.\n{why}"
            )

        return ServerSlot(
            lambda attempt: self.start(k, attempt),
            name=f"server s{k}",
            max_restarts=self.cfg.max_restarts,
            exhausted=exhausted,
            say=self.say,
        )

    def start(self, k: int, attempt: int) -> ModelServer:
        """Launch server `k` like the extract stage does (the same spec, readiness and canary)."""
        server = self.spec.server
        if server.device != "cpu" and "CUDA_VISIBLE_DEVICES" not in server.env:
            gpus = server_gpus(self.spec.train_gpus, k, server.tp_size)
            server = server.model_copy(update={"env": {**server.env, "CUDA_VISIBLE_DEVICES": gpus}})
        dump_dir = Path(self.spec.dump_root) / f"s{k}"
        dump_dir.mkdir(parents=True, exist_ok=True)
        spec = server_spec(
            self.cfg,
            server,
            self.target,
            index=k,
            local=0,
            num_local=1,
            attempt=attempt,
            dump_dir=dump_dir,
            log_dir=Path(self.spec.log_dir),
        )
        self.stats[k].address = spec.url

        def progress(fraction: float, message: str) -> None:
            self.say(f"server s{k}: {message}")

        srv = ModelServer(spec, progress=progress, canary=self.canary)
        srv.start()
        return srv

    def submit(self, job: _Job) -> None:
        if self.closed.is_set():
            raise TrainingError("the online feeder is closed")
        self.jobs.put(job)

    def _work(self, k: int, slot: ServerSlot) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if self.closed.is_set():  # answered all the same: the look-ahead may be waiting for it
                job.future.set_exception(TrainingError("the online feeder was closed before this request"))
                continue
            try:
                job.future.set_result(self._run(k, slot, job))
            except BaseException as exc:  # handed to the trainer's thread, never lost here
                job.future.set_exception(exc)
                self.closed.set()  # a failed feeder stops taking work; the trainer raises

    def _run(self, k: int, slot: ServerSlot, job: _Job) -> list[Features]:
        """The job's samples, its request redone on a restarted server until it succeeds or restarts run out."""
        while True:
            if self.closed.is_set():
                raise TrainingError("the online feeder was closed")
            server, generation = slot.get()
            try:
                samples = _request(server, self.cfg, job)
            except ServerUnavailable as exc:
                slot.failed(generation, exc)
                continue
            self.stats[k].served(job.tokens)
            return [encode(self.spec, self.target, s) for s in samples]

    def records(self) -> list[dict[str, Any]]:
        return [self.stats[k].record(slot) for k, slot in zip(self.stats, self.slots, strict=True)]

    def close(self) -> None:
        """Idempotent. Jobs still queued are failed by the threads before they end (none left waiting)."""
        self.closed.set()
        for _ in self.threads:
            self.jobs.put(None)
        for slot in self.slots:
            slot.stop()
        for t in self.threads:
            t.join(timeout=5)


def _request(server: ModelServer, cfg: ExtractConfig, job: _Job) -> list[HiddenSample]:
    """One `/generate` request through the extract stage's client. rids carry the job's number: the same
    row may be in flight twice (two epochs in one look-ahead), and each dump must be its own."""
    assert server.spec.dump_dir is not None
    request = Request(job.rows, [f"{job.split}-{r.index}-j{job.number}" for r in job.rows])

    async def run() -> list[HiddenSample]:
        client = ExtractionClient(
            server.url,
            server.spec.dump_dir,  # type: ignore[arg-type]
            request_timeout_s=cfg.request_timeout_s,
            dump_timeout_s=cfg.dump_timeout_s,
        )
        try:
            return await client.extract(request)
        finally:
            await client.aclose()

    return asyncio.run(run())


def encode(spec: OnlineSpec, target: TargetInfo, sample: HiddenSample) -> Features:
    """A dumped sample as its shard would return it: the shard writer's own check and encoding (bf16, or
    fp8 codes and per-token scales), ids int64 and the mask bool as `ShardReader.token_slice` gives them."""
    writer = _writer(spec, target)
    t = writer.check(sample)
    rows = writer.encode(sample, 0, t)
    out = {
        "input_ids": sample.input_ids.to(torch.int64),
        "loss_mask": sample.loss_mask.to(torch.bool),
        # Copies: the dump's pages are mapped and its file is gone; a buffer must own its bytes.
        "aux_hidden": rows.aux.clone(),
        "last_hidden": rows.last.clone(),
    }
    if rows.aux_scale is not None and rows.last_scale is not None:
        out["aux_scale"], out["last_scale"] = rows.aux_scale.clone(), rows.last_scale.clone()
    return out


_WRITERS: dict[tuple[str, int, int, int], ShardWriter] = {}
_WRITERS_LOCK = threading.Lock()


def _writer(spec: OnlineSpec, target: TargetInfo) -> ShardWriter:
    """A shard writer used only for `check` and `encode` (thread-safe, no writer state): one per format."""
    ex = spec.extract
    key = (ex.storage_dtype, target.geometry.hidden_size, target.geometry.vocab_size, ex.aux_layers)
    with _WRITERS_LOCK:
        if key not in _WRITERS:
            _WRITERS[key] = ShardWriter(
                Path(spec.cache_dir),
                storage=ex.storage_dtype,
                shard_bytes=ex.shard_bytes,
                hidden_size=target.geometry.hidden_size,
                vocab_size=target.geometry.vocab_size,
                aux_layers=ex.aux_layers,
            )
        return _WRITERS[key]


# --------------------------------------------------------------------------------------- the cache


class SampleCache:
    """Encoded samples on local disk, added until `limit` bytes are used (nothing evicted: what fits
    stays for the whole training). Off at limit 0."""

    def __init__(self, root: Path, limit: int) -> None:
        self.root, self.limit = root, limit
        self.used = 0
        self.hits = 0
        self.lock = threading.Lock()
        self.held: set[tuple[str, int]] = set()
        if limit:
            root.mkdir(parents=True, exist_ok=True)

    def _path(self, split: str, row: int) -> Path:
        return self.root / f"{split}-{row}.safetensors"

    def get(self, split: str, row: int) -> Features | None:
        with self.lock:
            if (split, row) not in self.held:
                return None
            self.hits += 1
        return load_file(str(self._path(split, row)))

    def put(self, split: str, row: int, features: Features) -> None:
        if not self.limit:
            return
        size = sum(t.numel() * t.element_size() for t in features.values())
        with self.lock:
            if (split, row) in self.held or self.used + size > self.limit:
                return
            self.used += size
        path = self._path(split, row)
        tmp = path.with_suffix(".part")
        save_file({k: v.contiguous() for k, v in features.items()}, str(tmp))
        tmp.replace(path)
        with self.lock:
            self.held.add((split, row))


# --------------------------------------------------------------------------------------- the feeder


class OnlineFeeder:
    """The data source of an online training (see the module docstring)."""

    def __init__(
        self, spec: OnlineSpec, cfg: TrainConfig, target: TargetInfo, dist: DistInfo, emit: Emit
    ) -> None:
        self.spec, self.cfg, self.target = spec, cfg, target
        lock = threading.Lock()

        def say(record: dict[str, Any]) -> None:
            with lock:  # the servers' threads report too
                emit(record)

        self.emit = say
        files = {split: s.files(split) for split, s in spec.splits.items()}
        self.tables = {split: RowTable(f) for split, f in files.items()}
        self.split_names = list(spec.splits)
        self.pool = ServerPool(spec, target, rank_servers(spec.extract.num_servers, dist.rank), files, say)
        self.cache = SampleCache(Path(spec.cache_dir) / "samples", cfg.online.cache_bytes)
        # Counted by the training look-ahead (the loader's thread) and an evaluation's (the trainer's).
        self.lock = threading.Lock()
        self.jobs = 0
        self.extracted_tokens = 0
        self.peak_buffered = 0

    def index(self, split: str) -> SampleIndex | None:
        """The split's samples (None where the split is not extracted or has no rows)."""
        table = self.tables.get(split)
        if table is None or not len(table.lengths):
            return None
        n = len(table.lengths)
        return SampleIndex.of_samples(
            shard=np.full(n, self.split_names.index(split), dtype=np.int32),
            begin=np.arange(n, dtype=np.int64),
            length=table.lengths,
            hidden_size=self.target.geometry.hidden_size,
            storage=self.spec.extract.storage_dtype,
        )

    def batches(
        self, plans: EpochPlans, first: int, stride: int, count: int | None = None
    ) -> Iterator[Batch]:
        return _LookAhead(self, plans, first, stride, count).run()

    def extract(self, split: str, rows: list[int]) -> _Job:
        """Send the rows (one split) to the servers as one request."""
        table = self.tables[split]
        with self.lock:
            job = _Job(split, [table.row(r) for r in rows], self.jobs)
            self.jobs += 1
            self.extracted_tokens += job.tokens
        self.pool.submit(job)
        return job

    def buffered(self, tokens: int) -> None:
        """A look-ahead holds `tokens` tokens of samples now."""
        with self.lock:
            self.peak_buffered = max(self.peak_buffered, tokens)

    def figures(self) -> dict[str, Any]:
        return {
            "servers": self.pool.records(),
            "requests": self.jobs,
            "extracted_tokens": self.extracted_tokens,
            "peak_buffered_tokens": self.peak_buffered,
            "cache_hits": self.cache.hits,
            "cache_bytes": self.cache.used,
        }

    def close(self) -> None:
        self.pool.close()


class _Held:
    """A sample requested for the look-ahead: where its features come from, how many rows still use it."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.uses = 0
        self.job: _Job | None = None
        self.slot = 0
        self.features: Features | None = None

    def get(self) -> Features:
        if self.features is None:
            assert self.job is not None
            self.features = self.job.future.result()[self.slot]
            self.job = None
        return self.features


class _LookAhead:
    """Rows first, first + stride, ... of `plans`, their samples requested `buffer_tokens` ahead."""

    def __init__(
        self, feeder: OnlineFeeder, plans: EpochPlans, first: int, stride: int, count: int | None
    ) -> None:
        self.feeder, self.plans = feeder, plans
        self.index = plans.index
        self.budget = feeder.cfg.online.buffer_tokens
        self.request_tokens = feeder.spec.extract.batch_tokens
        self.rows = (
            plans.pieces(first + i * stride) for i in (range(count) if count is not None else _forever())
        )
        self.ahead: deque[list[Piece]] = deque()
        self.held: dict[int, _Held] = {}
        self.waiting: list[int] = []  # samples to request, in the order the trainer needs them
        self.buffered = 0  # tokens of the held samples (each once, however many rows use it)
        self.planned = 0  # tokens of the rows ahead
        self.exhausted = False

    def run(self) -> Iterator[Batch]:
        reader = _FeatureReader(self.index, self.held)
        while True:
            self._fill()
            if not self.ahead:
                return
            pieces = self.ahead.popleft()
            self.planned -= sum(p.length for p in pieces)
            batch = reader.batch(pieces, self.plans.batch_tokens)
            for p in pieces:
                self._release(p.sample)
            yield batch

    def _fill(self) -> None:
        # Bounded by the rows ahead as well as by the samples held: on a corpus smaller than the budget,
        # later epochs take samples already held, and the held tokens alone would never reach it.
        while not self.exhausted and (
            not self.ahead or (self.buffered < self.budget and self.planned < self.budget)
        ):
            pieces = next(self.rows, None)
            if pieces is None:
                self.exhausted = True
                break
            self.ahead.append(pieces)
            self.planned += sum(p.length for p in pieces)
            for p in pieces:
                held = self.held.get(p.sample)
                if held is None:
                    held = self.held[p.sample] = _Held(int(self.index.length[p.sample]))
                    self.buffered += held.tokens
                    self.waiting.append(p.sample)
                held.uses += 1
        self.feeder.buffered(self.buffered)
        self._request()

    def _request(self) -> None:
        """Send the waiting samples: the cached ones read back, the others in requests of up to
        `extract.batch_tokens` tokens (a longer sample alone), one split per request."""
        group: list[int] = []
        tokens = 0
        split_of = self.feeder.split_names
        for sample in self.waiting:
            split, row = split_of[int(self.index.shard[sample])], int(self.index.begin[sample])
            cached = self.feeder.cache.get(split, row)
            if cached is not None:
                self.held[sample].features = cached
                continue
            n = self.held[sample].tokens
            if group and (
                tokens + n > self.request_tokens or self.index.shard[group[0]] != self.index.shard[sample]
            ):
                self._send(group)
                group, tokens = [], 0
            group.append(sample)
            tokens += n
        if group:
            self._send(group)
        self.waiting = []

    def _send(self, samples: list[int]) -> None:
        split = self.feeder.split_names[int(self.index.shard[samples[0]])]
        job = self.feeder.extract(split, [int(self.index.begin[s]) for s in samples])
        job.future.add_done_callback(lambda f: self._cache(f, split, job))
        for slot, sample in enumerate(samples):
            self.held[sample].job, self.held[sample].slot = job, slot

    def _cache(self, future: Future[list[Features]], split: str, job: _Job) -> None:
        if future.exception() is None:
            for row, features in zip(job.rows, future.result(), strict=True):
                self.feeder.cache.put(split, row.index, features)

    def _release(self, sample: int) -> None:
        held = self.held[sample]
        held.uses -= 1
        if held.uses == 0:
            del self.held[sample]
            self.buffered -= held.tokens


def _forever() -> Iterator[int]:
    i = 0
    while True:
        yield i
        i += 1


class _FeatureReader(BatchReader):
    """`BatchReader` over the look-ahead's held samples instead of shard files."""

    def __init__(self, index: SampleIndex, held: dict[int, _Held]) -> None:
        super().__init__(index)
        self.held = held

    def read(self, piece: Piece) -> dict[str, torch.Tensor]:
        try:
            features = self.held[piece.sample].get()
        except ServerError as exc:
            raise TrainingError(f"online training: a server failed for good: {exc}") from exc
        lo, hi = piece.start, piece.start + piece.length
        return {name: t[lo:hi] for name, t in features.items()}
