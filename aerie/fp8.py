"""fp8 (float8_e4m3fn) quantization with per-token, per-group absmax scales.

Shared by the reference server, which can quantize hidden states on its device before the
device->host copy (`--dump-dtype fp8`), and the extraction client, which quantizes model-dtype dumps
into fp8 shards: one function on both sides, so a CPU server and a CPU client write the same bytes.

`groups` splits each row into equal blocks that get their own scale: the aux hidden states are the
concatenation of several layers' residual streams, whose magnitudes differ, so each layer of each
token is scaled alone (the last hidden state is one group).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPE = torch.float8_e4m3fn


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [N, G*D] to float8_e4m3fn with one absmax scale per row per group: returns
    (q [N, G*D] float8_e4m3fn, scale [N, G] float32). Dequantized = q * scale.

    Written for throughput (the client quantizes every token it extracts): the absmax is taken in the
    input dtype (exact), and the one float32 copy is scaled in place. The cast to fp8 (torch's is a
    scalar loop on CPU) is most of the cost; a clamp, another full pass, runs only where it can
    change something (see below). Every step is per row, so rows quantized in any grouping (a whole
    pack, one sample, a row range) give the same bits."""
    if x.dim() != 2 or x.shape[1] % groups:
        raise ValueError(f"quantize_fp8 wants [N, G*D] with G={groups}, got {tuple(x.shape)}")
    n, width = x.shape
    xg = x.reshape(n, groups, width // groups)
    amax = xg.abs().amax(dim=2, keepdim=True).float()
    # A zero row gets scale 1 (its q is all zeros); non-finite values are refused upstream.
    # Divided by a tensor on amax's own device, never by the Python float: CUDA turns division by a
    # CPU scalar into multiplication by its reciprocal, which rounds differently for some amax (an
    # H200 gave other scales, hence other codes, than the CPU did), and the server's device
    # quantization must give the client's bits.
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    inv = scale.reciprocal()
    xf = xg.float() if xg.dtype != torch.float32 else xg.clone()
    xf.mul_(inv)
    # With a finite 1/scale, |x|*(1/s) <= amax*(1/s) = 448*(1 + ~3 float32 ulps), far below 464, from
    # where the cast would round past 448 (to NaN): a clamp would change no bit, so it is skipped.
    # Only a group so tiny (amax < ~1e-36) that 1/scale overflows to inf is divided instead (x*inf
    # would give +-inf, and NaN for zeros), and clamped: its denormal scale is rounded.
    # On a GPU that pass always runs: asking whether it is needed would synchronize with the device
    # (the server quantizes packs without waiting for them), and where 1/scale is finite the clamp and
    # the select change no bit, so the codes are the same either way.
    overflow = ~torch.isfinite(inv)
    if x.device.type != "cpu" or bool(overflow.any()):
        xf = torch.where(overflow, xg.float() / scale, xf).clamp_(-FP8_MAX, FP8_MAX)
    return xf.to(FP8_DTYPE).reshape(n, width), scale.reshape(n, groups)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of `quantize_fp8`: [N, G*D] in `dtype` (computed in float32, then cast)."""
    n, width = q.shape
    groups = scale.shape[1]
    x = q.float().reshape(n, groups, width // groups) * scale.float().reshape(n, groups, 1)
    return x.reshape(n, width).to(dtype)
