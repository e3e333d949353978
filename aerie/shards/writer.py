"""Packing samples into shards (layout: `aerie.shards`): `ShardWriter` decides which samples land in
which shard and encodes them (bf16, or fp8 with per-token scales); a `SealedShard` is one shard's
samples, decided and not yet on disk, which `aerie.shards.files` writes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aerie.errors import ExtractionError
from aerie.fp8 import FP8_DTYPE, quantize_fp8
from aerie.shards.files import WrittenShard, write_data
from aerie.shards.format import HiddenSample, ShardInfo, ids_dtype
from aerie.shards.schema import (
    AUX_LAYERS,
    SHARD_SCHEMA_VERSION,
    STORAGE_DTYPES,
    TENSOR_ORDER,
    Storage,
    bytes_per_token,
)
from aerie.tensorfile import TensorParts


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`; no torch call when it already is (each one gives the GIL back, per sample)."""
    return t if t.dtype == dtype else t.to(dtype)


@dataclass
class EncodedRows:
    """Rows [lo, hi) of one sample's hidden states in storage form: bf16, or fp8 codes and their
    scales. Rows are encoded independently (the fp8 scales are per token), so a sample encoded in
    row ranges gives the same bytes as encoded whole."""

    aux: torch.Tensor  # [n, kH], k captured layers
    last: torch.Tensor  # [n, H]
    aux_scale: torch.Tensor | None = None  # [n, k] uint8 (E8M0), fp8 only
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
    aux_layers: int = AUX_LAYERS

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
        k = self.aux_layers
        widths = {"aux_hidden": k * h, "last_hidden": h, "aux_scale": k, "last_scale": 1}
        tensors: list[TensorParts] = []
        for key in TENSOR_ORDER:
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
        return write_data(info, tensors, metadata, self.direct_io)

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
    `vocab_size` (the target's) lets the shards store token ids as uint16 where they fit;
    `aux_layers` is how many captured layers a sample's `aux_hidden` holds (EAGLE-3's three by default).
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
        aux_layers: int = AUX_LAYERS,
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
        self.aux_layers = aux_layers
        self._bpt = bytes_per_token(storage, hidden_size, vocab_size, aux_layers)
        self._reset()

    def _reset(self) -> None:
        self._chunks: dict[str, list[torch.Tensor]] = {name: [] for name in TENSOR_ORDER if name != "offsets"}
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
            "aux_hidden": (t, self.aux_layers * h),
            "last_hidden": (t, h),
        }
        if s.quantized or s.last_scale is not None:
            want.update(aux_scale=(t, self.aux_layers), last_scale=(t, 1))
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
        k = self.aux_layers
        aux_q, aux_s = quantize_fp8(aux.reshape(hi - lo, k * h).to(dev), groups=k)
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
            aux_layers=self.aux_layers,
        )
        self.index += 1
        self._reset()
        return sealed
