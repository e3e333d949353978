"""The drafter's attention backends, fed post-RoPE q/k/v by `aerie.draft.model`'s decoder layer.

Training-time test (TTT): query (step k, row t) sees step-0 keys at rows s <= t of its document, plus the
diagonal keys (step j, row t) for j = 1..k. The step-0 part is an ordinary causal document-masked
attention that also returns its log-sum-exp (torch's flex_attention on CUDA, or matmul attention per
document on the CPU, in blocks of query rows whose backward recomputes their scores, as flash attention
does); the diagonal part is k dot
products per row; the two are merged by their log-sum-exps. Nothing of size T x kT is ever built, and
nothing of size L x L for a document of L tokens: memory grows linearly with the sequence on both paths. Inference (`cached_attention`) is plain causal attention over a
KV cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

PAD_DOC = -1  # the document id of a packed row's padding: never supervised, so never attended
# Score elements (block rows x keys x heads) of one block of the CPU path: a block's fp32 scores and
# probabilities stay near 2 x 128 MiB however long the document, and the rows per block stay in
# BLOCK_ROWS so a 32K-token document is ~100 blocks, not thousands.
BLOCK_ELEMENTS = 1 << 25
BLOCK_ROWS = (64, 1024)


def cached_attention(q: Tensor, keys: Tensor, values: Tensor, start: int) -> Tensor:
    """q [n, nh, hd] at positions start..start+n-1; keys/values [L, nkv, hd] the cache including them.

    Each new row attends causally to everything cached up to its own position -> out [n, nh, hd].
    """
    rows = torch.arange(q.shape[0], device=q.device)[:, None] + start
    visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= rows  # [n, L]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=visible,
        enable_gqa=True,
    )  # [nh, n, hd]
    return out.transpose(0, 1)


class DocCausalMask:
    """Causal attention within documents of a packed row: row t sees rows s <= t with doc[s] == doc[t].

    `backend` "flex" builds a block mask for torch's flex_attention (CUDA; compiled); "dense" splits the
    row into its documents for matmul attention per document (CPU and tests), in blocks of query rows
    (`blocked_causal_attention`) once a document is longer than one block. The dense path skips
    the padding document (`PAD_DOC`): its rows are never supervised and no other row sees them, and its
    length-squared cost would otherwise dominate a short epoch's padded last row.
    """

    def __init__(self, doc_ids: Tensor, backend: str) -> None:
        self.backend = backend
        t = doc_ids.shape[0]
        if backend == "flex":
            from torch.nn.attention.flex_attention import create_block_mask

            docs = doc_ids

            def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
                return (kv <= q) & (docs[q] == docs[kv])

            self.block_mask = create_block_mask(
                mask_mod, None, None, t, t, device=str(doc_ids.device), _compile=doc_ids.is_cuda
            )
        elif backend == "dense":
            # Documents are contiguous runs of one id: attend within each run (cost sum(len^2), not T^2).
            starts = torch.nonzero(doc_ids[1:] != doc_ids[:-1]).flatten() + 1
            bounds = [0, *starts.tolist(), t]
            self.sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
            self.padding = [bool(doc_ids[a] == PAD_DOC) for a in bounds[:-1]]
        else:
            raise ValueError(f"unknown attention backend {backend!r} (flex or dense)")


def causal_doc_attention(q: Tensor, k: Tensor, v: Tensor, mask: DocCausalMask) -> tuple[Tensor, Tensor]:
    """q [T, nh, hd], k/v [T, nkv, hd] -> out [T, nh, hd], lse [T, nh] (fp32, natural log)."""
    if mask.backend == "flex":
        out, lse = _flex_attention(q.is_cuda)(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask.block_mask
        )  # out [1, nh, T, hd], lse [1, nh, T]
        return out[0].transpose(0, 1), lse[0].transpose(0, 1).float()
    outs, lses = [], []
    parts = zip(q.split(mask.sizes), k.split(mask.sizes), v.split(mask.sizes), mask.padding, strict=True)
    for qd, kd, vd, padding in parts:
        if padding:  # zeros with lse 0: finite, so the TTT merge and its gradients stay finite
            out, lse = torch.zeros_like(qd), qd.new_zeros(qd.shape[:2], dtype=_wide(qd.dtype))
        else:
            out, lse = blocked_causal_attention(qd, kd, vd)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def block_rows(length: int, heads: int) -> int:
    """Query rows per block for a document of `length` tokens and `heads` query heads."""
    low, high = BLOCK_ROWS
    return max(low, min(high, BLOCK_ELEMENTS // max(1, length * heads)))


def blocked_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, rows: int | None = None
) -> tuple[Tensor, Tensor]:
    """One document, q [L, nh, hd], k/v [L, nkv, hd] -> out [L, nh, hd], lse [L, nh], in blocks of `rows`
    query rows; a block sees the keys up to its last row. Each block is `BlockAttention`: its backward
    recomputes the block's scores from q/k and the saved lse, so what autograd keeps is q/k/v and the
    outputs, linear in L, and never an [L, L] matrix per head."""
    t = q.shape[0]
    rows = rows or block_rows(t, q.shape[1])
    record = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    outs, lses = [], []
    for s in range(0, t, rows):
        e = min(s + rows, t)
        if record:
            out, lse = BlockAttention.apply(q[s:e], k[:e], v[:e], s)
        else:
            out, lse = _block_forward(q[s:e], k[:e], v[:e], s)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs), torch.cat(lses)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype the block attention computes in: fp32 for fp32 and narrower inputs, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _grouped(q: Tensor, nkv: int) -> Tensor:
    """q [n, nh, hd] -> [nkv, g, n, hd] fp32, scaled by 1/sqrt(hd) (the score scale, applied once)."""
    n, nh, hd = q.shape
    return q.reshape(n, nkv, nh // nkv, hd).permute(1, 2, 0, 3).to(_wide(q.dtype)) / math.sqrt(hd)


def _probabilities(qg: Tensor, kf: Tensor, offset: int, lse: Tensor | None) -> tuple[Tensor, Tensor]:
    """Softmax probabilities [nkv, g, n, S] of query rows offset.. against keys 0..S-1 (row i sees keys
    <= offset + i) and their lse [nkv, g, n]; `lse` given (the backward) skips the reduction. In place on
    one score tensor: a block costs one [nkv, g, n, S] buffer."""
    nkv, g, n, hd = qg.shape
    scores = torch.bmm(qg.reshape(nkv, g * n, hd), kf.transpose(1, 2)).view(nkv, g, n, -1)  # [nkv, g, n, S]
    future = torch.ones(n, n, dtype=torch.bool, device=qg.device).triu(1)  # keys offset+i+1.. of row i
    scores[..., offset : offset + n].masked_fill_(future, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    return scores.sub_(lse[..., None]).exp_(), lse


def _block_forward(q: Tensor, k: Tensor, v: Tensor, offset: int) -> tuple[Tensor, Tensor]:
    """q [n, nh, hd] (rows offset..offset+n-1), k/v [S, nkv, hd] -> out [n, nh, hd], lse [n, nh] fp32."""
    n, nh, hd = q.shape
    nkv = k.shape[1]
    probs, lse = _probabilities(_grouped(q, nkv), k.transpose(0, 1).to(_wide(q.dtype)), offset, None)
    g = nh // nkv
    out = torch.bmm(probs.view(nkv, g * n, -1), v.transpose(0, 1).to(_wide(q.dtype))).view(nkv, g, n, hd)
    return out.permute(2, 0, 1, 3).reshape(n, nh, hd).to(q.dtype), lse.permute(2, 0, 1).reshape(n, nh)


class BlockAttention(torch.autograd.Function):
    """Causal attention of one block of query rows, differentiable in its output *and* its lse (the TTT
    merge weighs the step-0 attention by it). Forward keeps q/k/v, out and lse; backward recomputes the
    probabilities P and takes dS = P * (dP - rowsum(dO * O) + dlse), the softmax backward with the lse's
    own gradient added (d lse_i / d s_ij = P_ij)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, offset: int) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        out, lse = _block_forward(q, k, v, offset)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.offset = offset
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: Tensor, grad_lse: Tensor | None) -> tuple[Tensor, Tensor, Tensor, None]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        n, nh, hd = q.shape
        nkv = k.shape[1]
        g = nh // nkv
        qg = _grouped(q, nkv)  # [nkv, g, n, hd], scaled
        kf, vf = k.transpose(0, 1).to(_wide(q.dtype)), v.transpose(0, 1).to(_wide(q.dtype))  # [nkv, S, hd]
        lse_g = lse.reshape(n, nkv, g).permute(1, 2, 0)  # [nkv, g, n]
        probs, _ = _probabilities(qg, kf, ctx.offset, lse_g)
        d_out = grad_out.reshape(n, nkv, g, hd).permute(1, 2, 0, 3).to(_wide(q.dtype))  # [nkv, g, n, hd]
        o = out.reshape(n, nkv, g, hd).permute(1, 2, 0, 3).to(_wide(q.dtype))
        row = (d_out * o).sum(-1)  # [nkv, g, n]
        if grad_lse is not None:
            row = row - grad_lse.reshape(n, nkv, g).permute(1, 2, 0).to(_wide(q.dtype))
        flat_do = d_out.reshape(nkv, g * n, hd)
        d_v = torch.bmm(probs.view(nkv, g * n, -1).transpose(1, 2), flat_do)  # [nkv, S, hd], summed over g
        d_s = torch.bmm(flat_do, vf.transpose(1, 2)).view(nkv, g, n, -1)  # dP [nkv, g, n, S]
        d_s.sub_(row[..., None]).mul_(probs)
        del probs
        flat_ds = d_s.view(nkv, g * n, -1)
        d_q = torch.bmm(flat_ds, kf).view(nkv, g, n, hd) / math.sqrt(hd)
        d_k = torch.bmm(flat_ds.transpose(1, 2), qg.reshape(nkv, g * n, hd))  # [nkv, S, hd] (qg is scaled)
        return (
            d_q.permute(2, 0, 1, 3).reshape(n, nh, hd).to(q.dtype),
            d_k.transpose(0, 1).to(k.dtype),
            d_v.transpose(0, 1).to(v.dtype),
            None,
        )


def ttt_attention(q: Tensor, keys: list[Tensor], values: list[Tensor], mask: DocCausalMask) -> Tensor:
    """Attention of step k = len(keys)-1: q [T, nh, hd]; keys/values of steps 0..k, each [T, nkv, hd]."""
    out0, lse0 = causal_doc_attention(q, keys[0], values[0], mask)
    if len(keys) == 1:
        return out0
    t, nh, hd = q.shape
    nkv = keys[0].shape[1]
    wide = _wide(q.dtype)
    qg = q.reshape(t, nkv, nh // nkv, hd).to(wide)  # [T, nkv, g, hd]
    diag_k = torch.stack(keys[1:], dim=-2).to(wide)  # [T, nkv, k, hd]
    diag_v = torch.stack(values[1:], dim=-2).to(wide)  # [T, nkv, k, hd]
    diag = torch.einsum("tngd,tnjd->tngj", qg, diag_k) / math.sqrt(hd)  # [T, nkv, g, k]
    lse0 = lse0.to(wide).reshape(t, nkv, nh // nkv, 1)
    total = torch.logsumexp(torch.cat([lse0, diag], dim=-1), dim=-1, keepdim=True)  # [T, nkv, g, 1]
    out = torch.exp(lse0 - total) * out0.reshape(t, nkv, nh // nkv, hd).to(wide)
    out = out + torch.einsum("tngj,tnjd->tngd", torch.exp(diag - total), diag_v)
    return out.reshape(t, nh, hd).to(q.dtype)


_FLEX: dict[bool, Any] = {}


def _flex_attention(cuda: bool) -> Callable[..., tuple[Tensor, Tensor]]:
    """flex_attention returning (out, lse); compiled on CUDA (eager flex is a slow reference without CPU backward)."""
    if cuda not in _FLEX:
        from torch.nn.attention import flex_attention as fa

        def run(q: Tensor, k: Tensor, v: Tensor, block_mask: Any) -> tuple[Tensor, Tensor]:
            if hasattr(fa, "AuxRequest"):  # torch >= 2.9 spells the lse request this way
                out, aux = fa.flex_attention(
                    q, k, v, block_mask=block_mask, enable_gqa=True, return_aux=fa.AuxRequest(lse=True)
                )
                assert aux.lse is not None
                return out, aux.lse
            out, lse = fa.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_lse=True)
            return out, lse

        _FLEX[cuda] = torch.compile(run, dynamic=False) if cuda else run
    return _FLEX[cuda]
