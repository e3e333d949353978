"""EAGLE-3 hidden-state capture from a packed prefill.

Two tensors per token, exactly as DESIGN.md's capture contract defines them:

- `aux_hidden [T, 3H]`: the residual stream *entering* decoder layers `aux_layers` (input convention,
  default 2, N//2, N-3 = HF `output_hidden_states[i]`), concatenated in that order. A forward pre-hook
  on each of those layers records its input, so no other layer's states are kept.
- `last_hidden [T, H]`: the base model's output, i.e. after the final norm = the input of lm_head
  (the trainer recomputes the teacher distribution from it). lm_head itself is never run.

On CUDA the device->host copy does not hold up the model thread: `start` launches the forward, then
copies the two tensors into pinned host memory on a side stream and returns; the dump writer waits
for that copy (`PackCapture.wait`) while the next pack's forward already runs. Elsewhere, or with
`AERIE_REFSERVER_SYNC_COPY=1` in the server's environment (to compare, or if the overlap misbehaves
on some device), `start` computes and copies before it returns, as it always did.

With `dump_dtype="fp8"` (`--dump-dtype fp8`) both tensors are quantized on the model's device right
after the forward (`aerie.fp8.quantize_fp8`: float8_e4m3fn codes and per-token power-of-two scales
in a byte, one per aux layer per token, one per token for `last_hidden`), and the codes and scales are what
is copied to the host: half the bytes through the copy, the dump files and the client, and no
quantization on the client's CPUs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from aerie.engine.server.packed import Pack, choose_backend, make_pack, packed_attention, refusal
from aerie.fp8 import quantize_fp8

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SYNC_COPY_ENV = "AERIE_REFSERVER_SYNC_COPY"
DUMP_DTYPES = ("model", "fp8")
DumpDtype = Literal["model", "fp8"]


@dataclass(frozen=True)
class Capture:
    """One sequence's tensors, on the CPU, ready to be written."""

    input_ids: torch.Tensor  # [T] int32
    aux_hidden: torch.Tensor  # [T, len(aux_layers) * H] model dtype, or float8_e4m3fn codes
    last_hidden: torch.Tensor  # [T, H]
    aux_scale: torch.Tensor | None = None  # [T, len(aux_layers)] uint8 (E8M0), fp8 dumps only
    last_scale: torch.Tensor | None = None  # [T, 1]


@dataclass
class PackCapture:
    """One pack's captures, with how long its forward and its device->host copy took.

    `in_flight` packs (CUDA) hold host tensors that are still being filled: call `wait()` before
    reading them; it then fills `forward_s`/`copy_s` from CUDA events (GPU time: the forward from its
    start on the compute stream, the copy from the forward's end to the copy's end on the copy stream).
    Packs that are not in flight were computed and copied in `start`, timed by the host clock."""

    captures: list[Capture]
    forward_s: float = 0.0
    copy_s: float = 0.0
    _events: tuple[Any, Any, Any] | None = field(default=None, repr=False)

    @property
    def in_flight(self) -> bool:
        return self._events is not None

    def wait(self) -> None:
        """Block until the host copies are complete (re-raises a CUDA error of this pack's forward)."""
        if self._events is None:
            return
        start, forward_end, copied = self._events
        copied.synchronize()
        self.forward_s = start.elapsed_time(forward_end) / 1000
        self.copy_s = forward_end.elapsed_time(copied) / 1000
        self._events = None


class HiddenStateCapture:
    """Runs packed prefills of the target with capture hooks on the aux layers."""

    def __init__(
        self, model: PreTrainedModel, aux_layers: Sequence[int], device: str, dump_dtype: DumpDtype = "model"
    ) -> None:
        if dump_dtype not in DUMP_DTYPES:
            raise ValueError(f"dump_dtype must be one of {DUMP_DTYPES}, got {dump_dtype!r}")
        self.model = model
        self.base = model.base_model
        self.layers = _decoder_layers(self.base)
        self.aux_layers = tuple(aux_layers)
        self.device = device
        self.dump_dtype = dump_dtype
        # Packed prefill covers Llama-like attention; other architectures are prefilled per sequence.
        self.packed_refusal = refusal(model)
        # Where the device->host copies run, beside the forward passes (CUDA only; None = synchronous).
        overlap = str(device).startswith("cuda") and os.environ.get(SYNC_COPY_ENV, "") in ("", "0")
        self._copy_stream = torch.cuda.Stream(device) if overlap else None

    def forward_pack(self, pack: Pack) -> tuple[torch.Tensor, torch.Tensor]:
        """aux [T, kH] and last [T, H] for a packed row, on the model's device."""
        captured: dict[int, torch.Tensor] = {}
        handles = [
            self.layers[i].register_forward_pre_hook(_recorder(captured, i), with_kwargs=True)
            for i in set(self.aux_layers)
        ]
        try:
            if self.packed_refusal:
                return self._forward_each(pack, captured)
            with packed_attention(self.model):
                out = self.base(
                    input_ids=pack.input_ids,
                    position_ids=pack.position_ids,
                    use_cache=False,
                    cu_seq_lens_q=pack.cu_seqlens,
                    cu_seq_lens_k=pack.cu_seqlens,
                    max_length_q=pack.max_len,
                    max_length_k=pack.max_len,
                )
        finally:
            for h in handles:
                h.remove()
        aux = torch.cat([captured[i][0] for i in self.aux_layers], dim=-1)
        return aux, out.last_hidden_state[0]

    def _forward_each(
        self, pack: Pack, captured: dict[int, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed row's sequences one at a time through the model's own attention (no padding)."""
        bounds = pack.cu_seqlens.tolist()
        aux, last = [], []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            out = self.base(input_ids=pack.input_ids[:, start:end], use_cache=False)
            aux.append(torch.cat([captured[i][0] for i in self.aux_layers], dim=-1))
            last.append(out.last_hidden_state[0])
        return torch.cat(aux), torch.cat(last)

    def host_tensors(self, aux: torch.Tensor, last: torch.Tensor) -> list[torch.Tensor]:
        """What goes to the host for a pack, still on the model's device: [aux, last], or with fp8
        dumps [aux codes, last codes, aux scales, last scales]. Queued on the current stream, no sync."""
        if self.dump_dtype == "model":
            return [aux, last]
        aux_q, aux_s = quantize_fp8(aux, groups=len(self.aux_layers))
        last_q, last_s = quantize_fp8(last, groups=1)
        return [aux_q, last_q, aux_s, last_s]

    def choose_attention(self) -> str:
        """Pick the packed-prefill kernel on a probe of two sequences (`packed.choose_backend`: the
        fused varlen kernel only where it runs and agrees with the per-sequence loop); "per-sequence"
        for a model packed prefill refuses."""
        if self.packed_refusal:
            return "per-sequence"
        pack = make_pack([list(range(10, 30)), list(range(40, 47))], self.device)
        with torch.inference_mode():
            return choose_backend(lambda: self.forward_pack(pack)[1])

    def capture(self, sequences: Sequence[Sequence[int]]) -> list[Capture]:
        """Prefill the sequences in one packed forward and split the states per sequence."""
        pack = self.start(sequences)
        pack.wait()
        return pack.captures

    def start(self, sequences: Sequence[Sequence[int]]) -> PackCapture:
        """`capture`, returning before the host copy is complete where the device allows (CUDA)."""
        if self._copy_stream is None:
            return self._capture_now(sequences)
        return self._capture_async(sequences, self._copy_stream)

    def _capture_now(self, sequences: Sequence[Sequence[int]]) -> PackCapture:
        pack = make_pack(sequences, self.device)
        began = time.perf_counter()
        device_tensors = self.host_tensors(*self.forward_pack(pack))
        computed = time.perf_counter()
        host = [t.cpu() for t in device_tensors]  # one device->host copy per tensor per pack, then views
        copied = time.perf_counter()
        ids = pack.input_ids[0].to(device="cpu", dtype=torch.int32)
        return PackCapture(_split(ids, host, pack.cu_seqlens.tolist()), computed - began, copied - computed)

    def _capture_async(self, sequences: Sequence[Sequence[int]], copy_stream: Any) -> PackCapture:
        """Forward on the current stream, then copy into pinned host memory on `copy_stream`, without
        waiting: nothing here synchronizes with the device (the pack is built on the host and sent
        from pinned memory; ids and bounds come from the host copy), so the model thread goes on to
        the next pack while this one computes and copies."""
        host = make_pack(sequences, "cpu")
        compute = torch.cuda.current_stream(self.device)
        start, forward_end, copied = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record(compute)
        ids, pos, cu = (
            t.pin_memory().to(self.device, non_blocking=True)
            for t in (host.input_ids, host.position_ids, host.cu_seqlens)
        )
        pack = Pack(ids, pos, cu, host.max_len)
        # With fp8 dumps the quantization is part of the forward's time (it runs on the same stream).
        device_tensors = self.host_tensors(*self.forward_pack(pack))
        forward_end.record(compute)
        copy_stream.wait_event(forward_end)
        with torch.cuda.stream(copy_stream):
            host_tensors = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in device_tensors]
            for dst, src in zip(host_tensors, device_tensors, strict=True):
                dst.copy_(src, non_blocking=True)
            copied.record(copy_stream)
        # The device tensors are freed when this returns: keep the allocator off them until copied.
        for t in device_tensors:
            t.record_stream(copy_stream)
        host_ids = host.input_ids[0].to(torch.int32)
        captures = _split(host_ids, host_tensors, host.cu_seqlens.tolist())
        return PackCapture(captures, _events=(start, forward_end, copied))


def _split(ids: torch.Tensor, tensors: list[torch.Tensor], bounds: list[int]) -> list[Capture]:
    """Per-sequence views of the pack's host tensors ([aux, last] or [aux, last, aux_scale,
    last_scale]). Row ranges of contiguous [T, ...] tensors are contiguous: the dump writer serializes
    the views directly (a per-sample clone copied every byte of the pack once more). One `split` per
    tensor, not a slice per sample and tensor: this runs on the model thread between forwards."""
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    columns = [ids.split(lengths), *(t.split(lengths) for t in tensors)]
    return [Capture(*row) for row in zip(*columns, strict=True)]


def _recorder(captured: dict[int, torch.Tensor], index: int) -> Any:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured[index] = args[0] if args else kwargs["hidden_states"]

    return hook


def _decoder_layers(base: torch.nn.Module) -> torch.nn.ModuleList:
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(
            f"{type(base).__name__} has no `layers` ModuleList; the reference server captures hidden "
            "states of HF decoder-only models laid out like Llama (model.layers[i])"
        )
    return layers
