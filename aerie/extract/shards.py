"""Hidden-state shards: many samples concatenated along tokens in ~1 GB safetensors files.

Peers write one file per sample (millions of small files, a `torch.load` per step). aerie packs samples
into append-only shards instead, so training reads contiguous token ranges and the store holds a few
hundred objects. One shard holds::

    offsets     int64        [S+1]   sample i is tokens offsets[i]:offsets[i+1]
    input_ids   uint16|int32 [N]     uint16 when the target's vocabulary fits in it
    loss_mask   uint8        [N]
    aux_hidden  bf16|fp8     [N, 3H] residual stream entering the three captured layers, concatenated
    last_hidden bf16|fp8     [N, H]  after the final norm (the target lm_head's input)
    aux_scale   uint8        [N, 3]  fp8 only: one power-of-two scale per token per captured layer
    last_scale  uint8        [N, 1]  fp8 only

fp8 is float8_e4m3fn with a per-token (per layer) absmax scale: the residual stream's magnitude grows
with depth and varies a lot between tokens (attention sinks), so one scale per tensor would crush the
small ones. e4m3 keeps 3 mantissa bits: every element is within 2^-4 of its own magnitude. A scale is
a power of two in one byte (E8M0), so a token costs 4H + 4 bytes of states against bf16's 8H. The
scheme lives in `aerie.fp8`: the client quantizes with it, or the reference server already did
(`extract.quantize_on_server`) and the writer stores its codes and scales as they are.

Schema version 1 (float32 scales, int32 ids) is still read.

The safetensors metadata carries the schema version, storage dtype, hidden size and the sample ids
(JSON). A shard is written once, atomically (temp file + fsync + rename), and never modified.
The writer streams the safetensors layout itself (header, then each tensor's chunks in order) so a
1 GB shard is never concatenated in memory a second time, and its sha256 is computed while writing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import torch
from safetensors import safe_open

from aerie.diskspace import cannot_write
from aerie.errors import DataError, ExtractionError
from aerie.fp8 import FP8_DTYPE, SCALE_DTYPE, dequantize_fp8, quantize_fp8
from aerie.tensorfile import TensorParts, layout, open_direct, write_all, write_direct

SHARD_SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)
STORAGE_DTYPES = ("bf16", "fp8")
Storage = Literal["bf16", "fp8"]

# Order of tensors in the data section: widest alignment first, so every tensor starts aligned to its
# element size (the header is padded to 8 bytes, sizes of later tensors keep the alignment).
_ORDER = ("offsets", "aux_scale", "last_scale", "input_ids", "aux_hidden", "last_hidden", "loss_mask")


@dataclass
class HiddenSample:
    """One sample's hidden states, as the extraction client hands them to the writer and the reader
    gives them back (dequantized)."""

    id: str
    input_ids: torch.Tensor  # [T] integer (int32 as shards store them, or int64)
    loss_mask: torch.Tensor  # [T] bool or uint8 (0/1)
    aux_hidden: torch.Tensor  # [T, 3H]
    last_hidden: torch.Tensor  # [T, H]
    # Set when the states arrive already quantized (a server dumping fp8): aux_hidden and last_hidden
    # are then float8_e4m3fn codes and these their per-token scales, as a shard stores them.
    aux_scale: torch.Tensor | None = None  # [T, 3] uint8 (E8M0)
    last_scale: torch.Tensor | None = None  # [T, 1] uint8

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def quantized(self) -> bool:
        return self.aux_scale is not None


@dataclass(frozen=True)
class WriteTiming:
    """Where writing a shard spent its time (seconds), for the commit path's accounting
    (`aerie.extract.phases`): `data` in `SealedShard.write_data` (which also prepares the layout:
    offsets, concatenating ids, masks and scales, the header), the rest in `WrittenShard.sync`."""

    data: float = 0.0  # the writev calls (and queueing the buffers for the hash thread)
    hash_wait: float = 0.0  # waiting for the hash thread once the data was flushed and fsynced
    fsync: float = 0.0  # flush + fsync + close of the temp file, rename, fsync of the directory


@dataclass
class ShardInfo:
    """A closed shard: what the manifest and the progress file record."""

    name: str
    path: Path
    samples: int
    tokens: int
    bytes: int
    sha256: str
    sample_ids: list[str] = field(repr=False)
    # How long writing it took, by step (zeros where the info did not come from a write).
    timing: WriteTiming = field(default_factory=WriteTiming, repr=False, compare=False)

    def record(self) -> dict[str, Any]:
        """The manifest entry (no local path: the shard moves to the store)."""
        return {
            "name": self.name,
            "samples": self.samples,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "sha256": self.sha256,
        }


def ids_dtype(vocab_size: int | None) -> torch.dtype:
    """How a shard stores token ids: uint16 when every id of the vocabulary fits, else int32 (also
    when the vocabulary size is not known)."""
    return torch.uint16 if vocab_size is not None and vocab_size <= 1 << 16 else torch.int32


def bytes_per_token(storage: Storage, hidden_size: int, vocab_size: int | None = None) -> int:
    """Bytes one token costs in a shard (offsets, 8 bytes per sample, are left out)."""
    ids_and_mask = ids_dtype(vocab_size).itemsize + 1
    if storage == "bf16":
        return 4 * hidden_size * 2 + ids_and_mask
    return 4 * hidden_size + (3 + 1) * SCALE_DTYPE.itemsize + ids_and_mask


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`; no torch call when it already is (each one gives the GIL back, per sample)."""
    return t if t.dtype == dtype else t.to(dtype)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass
class EncodedRows:
    """Rows [lo, hi) of one sample's hidden states in storage form: bf16, or fp8 codes and their
    scales. Rows are encoded independently (the fp8 scales are per token), so a sample encoded in
    row ranges gives the same bytes as encoded whole."""

    aux: torch.Tensor  # [n, 3H]
    last: torch.Tensor  # [n, H]
    aux_scale: torch.Tensor | None = None  # [n, 3] uint8 (E8M0), fp8 only
    last_scale: torch.Tensor | None = None  # [n, 1]


@dataclass
class SealedShard:
    """A shard whose samples are decided, not yet on disk: `write` streams it out. Sealing and writing
    are apart so a commit pipeline can write one shard while it fills the next."""

    name: str
    path: Path
    chunks: dict[str, list[torch.Tensor]] = field(repr=False)
    sample_ids: list[str] = field(repr=False)
    lengths: list[int] = field(repr=False)
    storage: Storage
    hidden_size: int
    direct_io: bool = False  # write with O_DIRECT where the filesystem takes it
    ids_dtype: torch.dtype = torch.int32

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def write(self) -> ShardInfo:
        """Write the file (temp + fsync + rename) and return what the manifest records of it."""
        return self.write_data().sync()

    def write_data(self) -> WrittenShard:
        """Write the bytes to the shard's temp file; `sync` on the result makes it the shard."""
        offsets = torch.zeros(len(self.lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(self.lengths, dtype=torch.int64).cumsum(0)
        chunks = dict(self.chunks, offsets=[offsets])
        h = self.hidden_size
        n = self.tokens
        widths = {"aux_hidden": 3 * h, "last_hidden": h, "aux_scale": 3, "last_scale": 1}
        tensors: list[TensorParts] = []
        for key in _ORDER:
            parts = chunks[key]
            if not parts:
                continue
            if key not in ("aux_hidden", "last_hidden"):
                # Ids, mask and scales are a few bytes a token: one write (and one hash call) for the
                # shard instead of one per sample. The hidden states stream as they are.
                parts = [torch.cat(parts)]
            if key == "input_ids":
                parts = [self._narrow_ids(parts[0])]
            shape = [len(self.lengths) + 1] if key == "offsets" else [n]
            if key in widths:
                shape.append(widths[key])
            tensors.append(TensorParts(key, parts[0].dtype, shape, parts))
        metadata = {
            "schema_version": str(SHARD_SCHEMA_VERSION),
            "storage": self.storage,
            "hidden_size": str(h),
            "samples": str(len(self.sample_ids)),
            "tokens": str(n),
            "sample_ids": json.dumps(self.sample_ids),
        }
        info = ShardInfo(
            name=self.name,
            path=self.path,
            samples=len(self.sample_ids),
            tokens=n,
            bytes=0,
            sha256="",
            sample_ids=list(self.sample_ids),
        )
        return _write_data(info, tensors, metadata, self.direct_io)

    def _narrow_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The shard's ids in `ids_dtype`, checked once per shard (a cast would wrap silently)."""
        if ids.dtype == self.ids_dtype:
            return ids
        if self.ids_dtype == torch.uint16 and (int(ids.min()) < 0 or int(ids.max()) >= 1 << 16):
            raise ExtractionError(
                f"shard {self.name}: token ids outside [0, 65536) ({int(ids.min())}..{int(ids.max())}), "
                "but the target's vocabulary fits in uint16: the corpus was not tokenized for this target"
            )
        return ids.to(self.ids_dtype)


class ShardWriter:
    """Packs samples, in the order given, into shards of about `shard_bytes` each.

    A sample never spans two shards: when adding it would push the open shard past `shard_bytes`, the
    open shard is closed first. Which samples land in which shard therefore depends only on the sample
    order and sizes, which makes re-runs reproduce the same shards (resume relies on it).

    `add` does everything in the caller's thread. Its steps are also public for a pipeline
    (`aerie.extract.commit`): `check` and `encode` (thread-safe: the costly part, quantization) in any
    thread, `append` and `seal` in sample order from one thread, `SealedShard.write` anywhere.
    `vocab_size` (the target's) lets the shards store token ids as uint16 where they fit.
    """

    def __init__(
        self,
        out_dir: Path,
        *,
        storage: Storage,
        shard_bytes: int,
        hidden_size: int,
        prefix: str = "shard",
        first_index: int = 0,
        quantize_device: str = "cpu",
        direct_io: bool = False,
        vocab_size: int | None = None,
    ) -> None:
        if storage not in STORAGE_DTYPES:
            raise ValueError(f"storage must be one of {STORAGE_DTYPES}, got {storage!r}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.storage: Storage = storage
        self.shard_bytes = shard_bytes
        self.hidden_size = hidden_size
        self.prefix = prefix
        self.index = first_index
        self.quantize_device = quantize_device
        self.direct_io = direct_io
        self.ids_dtype = ids_dtype(vocab_size)
        self._bpt = bytes_per_token(storage, hidden_size, vocab_size)
        self._reset()

    def _reset(self) -> None:
        self._chunks: dict[str, list[torch.Tensor]] = {name: [] for name in _ORDER if name != "offsets"}
        self._ids: list[str] = []
        self._lengths: list[int] = []
        self._tokens = 0

    @property
    def pending_samples(self) -> int:
        return len(self._ids)

    def _pending_bytes(self) -> int:
        return self._tokens * self._bpt + 8 * (len(self._ids) + 1)

    def add(self, sample: HiddenSample) -> ShardInfo | None:
        """Append one sample; returns the info of the shard this closed, if any."""
        t = self.check(sample)
        sealed = self.append(sample, [self.encode(sample, 0, t)])
        return sealed.write() if sealed is not None else None

    def close(self) -> ShardInfo | None:
        """Write the open shard, if it holds any sample."""
        sealed = self.seal()
        return sealed.write() if sealed is not None else None

    def check(self, s: HiddenSample) -> int:
        """The sample's token count; `ExtractionError` unless its tensors fit this writer."""
        t = int(s.input_ids.shape[0])
        h = self.hidden_size
        want = {
            "input_ids": (t,),
            "loss_mask": (t,),
            "aux_hidden": (t, 3 * h),
            "last_hidden": (t, h),
        }
        if s.quantized or s.last_scale is not None:
            want.update(aux_scale=(t, 3), last_scale=(t, 1))
            if self.storage != "fp8":
                raise ExtractionError(
                    f"sample {s.id!r} arrives quantized to fp8 but this writer stores {self.storage}: "
                    "writing it would keep fp8's rounding in a bf16 shard (quantize on the server only "
                    "with storage_dtype fp8)"
                )
        for name, shape in want.items():
            value = getattr(s, name)
            got = tuple(value.shape) if value is not None else None
            if got != shape:
                raise ExtractionError(f"sample {s.id!r}: {name} has shape {got}, expected {shape}")
        if s.quantized and (s.aux_hidden.dtype, s.last_hidden.dtype) != (FP8_DTYPE, FP8_DTYPE):
            raise ExtractionError(
                f"sample {s.id!r} has fp8 scales but its states are {s.aux_hidden.dtype} / "
                f"{s.last_hidden.dtype}, not {FP8_DTYPE}"
            )
        if t == 0:
            raise ExtractionError(f"sample {s.id!r} has no tokens")
        # int32 ids (a dump's, compared with the corpus's by the client) fit by their type: no min/max.
        if s.input_ids.dtype != torch.int32 and (
            int(s.input_ids.min()) < 0 or int(s.input_ids.max()) >= 2**31
        ):
            raise ExtractionError(f"sample {s.id!r}: token ids outside int32")
        return t

    def needs_encoding(self, sample: HiddenSample) -> bool:
        """Whether `encode` does more than slice: a cast or fp8 quantization (work for a pool)."""
        if self.storage == "bf16":
            return (sample.aux_hidden.dtype, sample.last_hidden.dtype) != (torch.bfloat16, torch.bfloat16)
        return not sample.quantized

    def encode(self, sample: HiddenSample, lo: int, hi: int) -> EncodedRows:
        """Rows [lo, hi) of a checked sample in storage form. Reads no writer state: safe in any
        thread, in any order."""
        h = self.hidden_size
        whole = lo == 0 and hi == sample.tokens

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t if whole else t[lo:hi]  # a whole sample unsliced: fewer torch calls per sample

        aux, last = rows(sample.aux_hidden), rows(sample.last_hidden)
        if self.storage == "bf16":
            return EncodedRows(_as_dtype(aux, torch.bfloat16), _as_dtype(last, torch.bfloat16))
        if sample.aux_scale is not None and sample.last_scale is not None:
            # Quantized by the server with the same function: the codes and scales are the shard's.
            return EncodedRows(aux, last, rows(sample.aux_scale), rows(sample.last_scale))
        # fp8 quantization touches every value; `quantize_device` may move it to a GPU.
        dev = self.quantize_device
        aux_q, aux_s = quantize_fp8(aux.reshape(hi - lo, 3 * h).to(dev), groups=3)
        last_q, last_s = quantize_fp8(last.reshape(hi - lo, h).to(dev), groups=1)
        if dev != "cpu":
            aux_q, aux_s, last_q, last_s = (v.cpu() for v in (aux_q, aux_s, last_q, last_s))
        return EncodedRows(aux_q, last_q, aux_s, last_s)

    def append(self, sample: HiddenSample, rows: list[EncodedRows]) -> SealedShard | None:
        """Add a checked sample, encoded (`rows` cover its tokens in order), to the open shard; when
        it does not fit there, the open shard is sealed first and returned (to be written)."""
        t = int(sample.input_ids.shape[0])
        if sum(int(r.aux.shape[0]) for r in rows) != t:
            raise ExtractionError(
                f"internal: the encoded rows of sample {sample.id!r} do not cover its {t} tokens"
            )
        sealed = None
        if self._ids and self._pending_bytes() + t * self._bpt + 8 > self.shard_bytes:
            sealed = self.seal()
        self._chunks["input_ids"].append(_as_dtype(sample.input_ids, torch.int32))
        self._chunks["loss_mask"].append(_as_dtype(sample.loss_mask, torch.uint8))
        for r in rows:
            self._chunks["aux_hidden"].append(r.aux)
            self._chunks["last_hidden"].append(r.last)
            if r.aux_scale is not None and r.last_scale is not None:
                self._chunks["aux_scale"].append(r.aux_scale)
                self._chunks["last_scale"].append(r.last_scale)
        self._ids.append(sample.id)
        self._lengths.append(t)
        self._tokens += t
        return sealed

    def seal(self) -> SealedShard | None:
        """Close the open shard without writing it (None when it holds no sample); the next sample
        opens the next index."""
        if not self._ids:
            return None
        name = f"{self.prefix}-{self.index:05d}.safetensors"
        sealed = SealedShard(
            name=name,
            path=self.out_dir / name,
            chunks=self._chunks,
            sample_ids=self._ids,
            lengths=self._lengths,
            storage=self.storage,
            hidden_size=self.hidden_size,
            direct_io=self.direct_io,
            ids_dtype=self.ids_dtype,
        )
        self.index += 1
        self._reset()
        return sealed


class _HashBehind:
    """sha256 fed from a second thread, in order, so hashing a shard overlaps writing it: both
    release the GIL on large buffers, and a shard then costs max(write, hash) instead of their sum
    (sha256 runs at about the speed of a page-cache write)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aerie-shard-hash")

    def update(self, parts: list[memoryview]) -> None:
        """Hash `parts` in order, after what came before: one task, so a shard's thousand parts cost
        one hand-off to the hash thread, not one each."""
        self._pool.submit(self._update, list(parts))

    def _update(self, parts: list[memoryview]) -> None:
        for part in parts:
            self._h.update(part)

    def hexdigest(self) -> str:
        self._pool.shutdown(wait=True)
        return self._h.hexdigest()

    def cancel(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class WrittenShard:
    """A shard's bytes in its temp file, not yet durable. `sync` makes it the shard (flush, fsync,
    rename, fsync of the directory) and returns its info; `discard` removes the temp file. Writing and
    syncing are apart so a commit pipeline can fsync one shard while it writes the next: the disk then
    never waits for the writer between shards."""

    def __init__(self, info: ShardInfo, tmp: Path, f: BinaryIO, hasher: _HashBehind, data_s: float) -> None:
        self._info = info
        self._tmp = tmp
        self._f = f
        self._hasher = hasher
        self._data_s = data_s

    @property
    def data_s(self) -> float:
        """Seconds the data took to write (the writev calls)."""
        return self._data_s

    def sync(self) -> ShardInfo:
        began = time.perf_counter()
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            synced = time.perf_counter()
            digest = self._hasher.hexdigest()
            hashed = time.perf_counter()
            os.replace(self._tmp, self._info.path)
            _fsync_dir(self._info.path.parent)
        except BaseException as exc:
            _drop_temp(self._hasher, self._f, self._tmp)
            if isinstance(exc, OSError):
                raise _cannot_write_shard(self._info.path, exc) from exc
            raise
        timing = WriteTiming(
            data=self._data_s, hash_wait=hashed - synced, fsync=synced - began + time.perf_counter() - hashed
        )
        return dataclasses.replace(self._info, sha256=digest, timing=timing)

    def discard(self) -> None:
        """Drop the temp file: this shard will not be written (its pipeline failed or stopped)."""
        _drop_temp(self._hasher, self._f, self._tmp)


def _drop_temp(hasher: _HashBehind, f: BinaryIO | None, tmp: Path) -> None:
    """Stop hashing, close and remove a shard's temp file; cleanup must not hide why the write failed."""
    hasher.cancel()
    if f is not None:
        with contextlib.suppress(OSError):
            f.close()
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)


def _cannot_write_shard(path: Path, exc: OSError) -> ExtractionError:
    return ExtractionError(cannot_write(path, exc, "shard"))


_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def _write_data(
    info: ShardInfo, tensors: list[TensorParts], metadata: dict[str, str], direct_io: bool
) -> WrittenShard:
    """Write the safetensors layout to a temp file beside `info.path`, streaming each tensor's
    chunks (`aerie.tensorfile`) and hashing them in a second thread. With `direct_io` the file is
    written with O_DIRECT where its filesystem takes it (`aerie.tensorfile.write_direct`)."""
    parts, size = layout(tensors, metadata)
    tmp = info.path.with_name(f".{info.path.name}.tmp")
    # Hashed on the shard's own thread: a shard's hash (slower than its write on the H200 hosts, whose
    # sync threads waited on it 10-25% of the wall, `write_hash_wait`) then overlaps the writing of the
    # next shard instead of holding up this one's writes.
    h = _HashBehind()
    f: BinaryIO | None = None
    try:
        fd, direct = open_direct(tmp) if direct_io else (os.open(tmp, _NEW_FILE, 0o644), False)
        f = open(fd, "wb", buffering=0)  # noqa: SIM115 - closed by WrittenShard.sync or discard
        began = time.perf_counter()
        h.update(parts)
        (write_direct if direct else write_all)(fd, parts)
        data_s = time.perf_counter() - began
    except BaseException as exc:
        _drop_temp(h, f, tmp)
        if isinstance(exc, OSError):
            raise _cannot_write_shard(info.path, exc) from exc
        raise
    return WrittenShard(dataclasses.replace(info, bytes=size), tmp, f, h, data_s)


class ShardReader:
    """Reads a shard (memory-mapped by safetensors): per sample or by contiguous token range.

    fp8 tensors are dequantized to `dtype` on read; `token_slice(..., dequantize=False)` returns the
    raw fp8 codes and scales instead, so a trainer can move half the bytes to the GPU and dequantize
    there.
    """

    def __init__(self, path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> None:
        self.path = Path(path)
        self.device = device
        self.dtype = dtype
        try:
            self._f = safe_open(str(self.path), framework="pt", device=device)
        except Exception as exc:  # safetensors raises its own SafetensorError / OSError
            raise DataError(f"cannot open shard {self.path}: {exc}") from exc
        meta = self._f.metadata() or {}
        try:
            version = int(meta["schema_version"])
            self.storage: Storage = meta["storage"]  # type: ignore[assignment]
            self.hidden_size = int(meta["hidden_size"])
            self.sample_ids: list[str] = json.loads(meta["sample_ids"])
        except (KeyError, ValueError) as exc:
            raise DataError(f"{self.path} is not an aerie hidden-state shard (metadata: {exc})") from exc
        if version not in READABLE_SCHEMA_VERSIONS:
            raise DataError(
                f"{self.path}: shard schema version {version}, this aerie reads {READABLE_SCHEMA_VERSIONS}"
            )
        self.offsets: torch.Tensor = self._f.get_tensor("offsets").cpu()
        self.tokens = int(self.offsets[-1])

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __iter__(self) -> Iterator[HiddenSample]:
        for i in range(len(self)):
            yield self.sample(i)

    def sample(self, i: int) -> HiddenSample:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {self.path.name} ({len(self)} samples)")
        i %= len(self)
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        part = self.token_slice(start, end)
        return HiddenSample(
            id=self.sample_ids[i],
            input_ids=part["input_ids"],
            loss_mask=part["loss_mask"],
            aux_hidden=part["aux_hidden"],
            last_hidden=part["last_hidden"],
        )

    def token_slice(self, start: int, end: int, *, dequantize: bool = True) -> dict[str, torch.Tensor]:
        """Tokens [start, end) of the shard (across sample boundaries): input_ids int64, loss_mask
        bool, aux_hidden [n, 3H], last_hidden [n, H] (plus aux_scale/last_scale when fp8 and not
        dequantized)."""
        if not 0 <= start <= end <= self.tokens:
            raise IndexError(
                f"token range [{start}, {end}) out of range for {self.path.name} ({self.tokens})"
            )
        out = {
            "input_ids": self._f.get_slice("input_ids")[start:end].long(),
            "loss_mask": self._f.get_slice("loss_mask")[start:end].bool(),
        }
        aux = self._f.get_slice("aux_hidden")[start:end]
        last = self._f.get_slice("last_hidden")[start:end]
        if self.storage == "fp8":
            aux_s = self._f.get_slice("aux_scale")[start:end]
            last_s = self._f.get_slice("last_scale")[start:end]
            if not dequantize:
                out.update(aux_hidden=aux, last_hidden=last, aux_scale=aux_s, last_scale=last_s)
                return out
            aux, last = dequantize_fp8(aux, aux_s, self.dtype), dequantize_fp8(last, last_s, self.dtype)
        else:
            aux, last = aux.to(self.dtype), last.to(self.dtype)
        out.update(aux_hidden=aux, last_hidden=last)
        return out
