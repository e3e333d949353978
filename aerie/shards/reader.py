"""Reading a shard back (layout: `aerie.shards`): per sample, or by contiguous token range for a
trainer that packs rows across sample boundaries."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from aerie.errors import DataError
from aerie.fp8 import dequantize_fp8
from aerie.shards.format import HiddenSample
from aerie.shards.schema import READABLE_SCHEMA_VERSIONS, Storage


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
        bool, aux_hidden [n, kH], last_hidden [n, H] (plus aux_scale/last_scale when fp8 and not
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
