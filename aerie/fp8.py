"""fp8 (float8_e4m3fn) quantization with per-token, per-group power-of-two scales.

Shared by the reference server, which can quantize hidden states on its device before the
device->host copy (`--dump-dtype fp8`), and the extraction client, which quantizes model-dtype dumps
into fp8 shards: one function on both sides, so a CPU server and a CPU client write the same bytes.

`groups` splits each row into equal blocks that get their own scale: the aux hidden states are the
concatenation of several layers' residual streams, whose magnitudes differ, so each layer of each
token is scaled alone (the last hidden state is one group).

A scale is a power of two, stored as one byte: its biased exponent (E8M0, the scale format of the OCP
microscaling formats), 2**(byte - 127). A float32 scale would cost 4 bytes per group, 16 per token
with four groups, where the codes cost 4H. A power of two loses nothing that matters: e4m3 is a float
format, so its relative precision (3 mantissa bits) is the same wherever the group's absmax lands in
(224, 448]; only the subnormal floor rises, by at most one binade. And scaling by a power of two is
exact, so every device gives the same codes for the same input (an absmax/448 division does not:
CUDA rounds it differently from the CPU).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn: 0.875 * 2**9
FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.uint8  # biased exponent, E8M0
_BIAS = 127
# Exponents are kept in [-126, 126], so both 2**e and 2**-e are normal float32 numbers, built exactly
# from their bits. No finite float32 absmax needs more than 2**120; a group whose absmax is under
# ~2**-117 is scaled by 2**126 and keeps fewer codes (it is far below anything a model carries).
_MIN_EXP, _MAX_EXP = -126, 126


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2.0**exponent as float32, exactly (from the bits), for integer exponents in [-126, 127]."""
    return ((exponent.to(torch.int32) + _BIAS) << 23).view(torch.float32)


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """The float32 scales: decoded from E8M0 bytes, or as they are (float32 scales, as shards of
    schema version 1 stored them)."""
    if scale.dtype == SCALE_DTYPE:
        return pow2(scale.to(torch.int32) - _BIAS)
    return scale.float()


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [N, G*D] to float8_e4m3fn with one power-of-two scale per row per group: returns
    (q [N, G*D] float8_e4m3fn, scale [N, G] uint8 biased exponents). Dequantized = q * 2**(scale-127).

    The scale of a group is the smallest power of two 2**e with absmax / 2**e <= 448, from the
    absmax's exponent (`frexp`, exact): absmax = m * 2**k with m in [0.5, 1), and 448 = 0.875 * 2**9,
    so e = k - 9, or k - 8 when m > 0.875. Written for throughput (the client quantizes every token it
    extracts): the absmax is taken in the input dtype (exact), the one float32 copy is scaled in place
    (exact: a power of two), and no clamp is needed (every scaled value is within 448). The cast to fp8
    (torch's is a scalar loop on CPU) is most of the cost. Every step is per row, so rows quantized in
    any grouping (a whole pack, one sample, a row range) give the same bits."""
    if x.dim() != 2 or x.shape[1] % groups:
        raise ValueError(f"quantize_fp8 wants [N, G*D] with G={groups}, got {tuple(x.shape)}")
    n, width = x.shape
    xg = x.reshape(n, groups, width // groups)
    mantissa, exponent = torch.frexp(xg.abs().amax(dim=2, keepdim=True).float())
    # A zero group gets e = -9 (frexp(0) is (0, 0)): its codes are zeros whatever the scale.
    e = (exponent - 9 + (mantissa > 0.875).to(torch.int32)).clamp_(_MIN_EXP, _MAX_EXP)
    xf = xg.float() if xg.dtype != torch.float32 else xg.clone()
    xf.mul_(pow2(-e))
    return xf.to(FP8_DTYPE).reshape(n, width), (e + _BIAS).to(SCALE_DTYPE).reshape(n, groups)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of `quantize_fp8`: [N, G*D] in `dtype` (computed in float32, then cast). `scale` is
    E8M0 bytes, or float32 scales (shards of schema version 1)."""
    n, width = q.shape
    groups = scale.shape[1]
    x = q.float().reshape(n, groups, width // groups) * scale_values(scale).reshape(n, groups, 1)
    return x.reshape(n, width).to(dtype)
