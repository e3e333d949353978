"""Packed prefill: many sequences in ONE forward row, no padding, each attending only to itself.

Extraction throughput is set by how few wasted FLOPs a batch carries (packed full batches
run ~4x faster than padded length-sorted ones on an H200). The sequences of a batch are concatenated
into a single row `[1, sum(T_i)]` with positions restarting at 0 per sequence; every projection and
MLP then runs on real tokens only. Attention must not cross sequences, so the model runs with a
registered attention function, `aerie_packed`, that is causal *within* each segment given by
`cu_seq_lens_q` (the flash-attention varlen convention transformers already passes through):

- on CUDA (bf16/fp16): `torch.nn.attention.varlen.varlen_attn`, one kernel for the whole row;
- elsewhere: a loop of causal SDPA calls, one per segment (sum of T_i^2, never (sum T_i)^2).

transformers builds no mask for an attention implementation it does not know, which is what we
want: the segment boundaries are the mask. Generation keeps using SDPA with its usual padding mask.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PACKED_ATTENTION = "aerie_packed"

# "loop" until a warm-up proves the fused kernel works and agrees (see choose_backend).
_backend: dict[str, str] = {"name": "loop"}


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: q [1, Hq, T, D], k/v [1, Hkv, T, D] -> [1, T, Hq, D]."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        raise RuntimeError("aerie_packed attention needs one packed row and cu_seq_lens_q")
    # The backend is chosen per process on the first model's probe; a float32 model loaded later in
    # the same process (tests, a CPU-dtype generation server) must not reach the half-only kernel.
    if _backend["name"] == "varlen" and query.dtype in (torch.float16, torch.bfloat16):
        return _varlen(query, key, value, cu, int(kwargs["max_length_q"]), scaling), None
    return _segment_loop(query, key, value, cu, scaling), None


def _segment_loop(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    bounds = cu.tolist()
    parts = [
        F.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling
        )
        for s, e in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def _varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scaling: float | None,
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    causal, native_gqa = _varlen_api()
    extra: dict[str, Any] = dict(causal)
    if native_gqa:
        extra["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    cu32 = cu.to(device=q.device, dtype=torch.int32)
    out = varlen_attn(q, k, v, cu32, cu32, max_len, max_len, scale=scaling, **extra)
    assert isinstance(out, torch.Tensor)
    return out.unsqueeze(0)


@functools.cache
def _varlen_api() -> tuple[dict[str, Any], bool]:
    """(the causal keyword, whether grouped-query heads are native) of the installed torch, read once:
    the API moved between releases (2.10 takes is_causal, later ones a (left, right) window; only the
    newer ones take enable_gqa)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return causal, "enable_gqa" in params


def refusal(model: PreTrainedModel) -> str:
    """Why packed prefill cannot run this model exactly ("" when it can). The packed row is attended
    by causal SDPA per segment: attention sinks (GPT-OSS) and sliding windows shorter than the context
    are not in it. Such a model is prefilled one sequence at a time through its own attention."""
    cfg = model.config
    if any(getattr(m, "sinks", None) is not None for m in model.modules()):
        return "its attention has sinks"
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return "some layers attend through a sliding window"
    window = getattr(cfg, "sliding_window", None)
    if (
        window
        and getattr(cfg, "use_sliding_window", True)
        and window < getattr(cfg, "max_position_embeddings", 0)
    ):
        return f"it attends through a sliding window of {window} tokens"
    return ""


def register() -> None:
    """Make `aerie_packed` known to transformers' attention dispatch (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)


@contextlib.contextmanager
def packed_attention(model: PreTrainedModel) -> Iterator[None]:
    """Run the model with segment-causal attention inside the block, SDPA again after it."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        model.config._attn_implementation = previous


@dataclass(frozen=True)
class Pack:
    """One packed row: ids and positions `[1, T]`, segment boundaries `cu_seqlens [n+1]`."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int

    @property
    def lengths(self) -> list[int]:
        c = self.cu_seqlens.tolist()
        return [b - a for a, b in zip(c[:-1], c[1:], strict=True)]


def make_pack(sequences: Sequence[Sequence[int]], device: str) -> Pack:
    """The packed row of `sequences`. Built on the extraction server's model thread between forwards,
    holding the GIL, so without a Python step per token or per sequence: numpy reads the ids from the
    lists in one pass (a nested comprehension into `torch.tensor` took 2-3x as long on 64K tokens), and
    positions are one subtraction (each token's index minus its sequence's start)."""
    lengths = [len(s) for s in sequences]
    if not lengths or min(lengths) == 0:
        raise ValueError("every packed sequence needs at least one token")
    total = sum(lengths)
    ids = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=total))
    n = torch.tensor(lengths, dtype=torch.long)
    ends = n.cumsum(0)
    pos = torch.arange(total, dtype=torch.long) - torch.repeat_interleave(ends - n, n)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = ends
    return Pack(ids[None].to(device), pos[None].to(device), cu.to(device), max(lengths))


def plan_packs(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices, in order, into packs of at most max_tokens (a longer one goes alone)."""
    packs: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if current and used + n > max_tokens:
            packs.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        packs.append(current)
    return packs


def choose_backend(probe: Any) -> str:
    """Use the fused varlen kernel only where it runs and agrees with the segment loop on a probe.

    `probe()` runs a packed forward and returns its output; it is called once per backend.
    """
    _backend.update(name="loop", reason="")
    reference = probe()
    if not reference.is_cuda or reference.dtype == torch.float32:
        return "loop"
    try:
        _backend["name"] = "varlen"
        fused = probe()
    except (RuntimeError, ImportError, TypeError) as exc:
        _backend["name"] = "loop"
        _backend["reason"] = f"varlen kernel failed: {type(exc).__name__}: {exc}"[:300]
        return "loop"
    # Judged relative to the states' norm: two correct bf16 kernels summing in different orders differ
    # elementwise (max abs 0.5 seen on an H200 after 30 layers); a wrong mask or layout is off by O(1).
    fused, reference = fused.detach().float(), reference.detach().float()
    error = float((fused - reference).norm() / reference.norm().clamp_min(1e-6))
    if error > 2e-2:
        _backend["name"] = "loop"
        _backend["reason"] = f"varlen kernel disagrees with the segment loop (relative error {error:.3g})"
    return _backend["name"]


def backend_reason() -> str:
    """Why the last choose_backend fell back to the loop ("" when it did not)."""
    return _backend.get("reason", "") if _backend["name"] == "loop" else ""
