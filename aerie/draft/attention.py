"""The drafter's attention backends, fed post-RoPE q/k/v by `aerie.draft.model`'s decoder layer.

Training-time test (TTT): query (step k, row t) sees step-0 keys at rows s <= t of its document, plus the
diagonal keys (step j, row t) for j = 1..k. The step-0 part is an ordinary causal document-masked
attention that also returns its log-sum-exp (torch's flex_attention on CUDA, or plain matmul attention per
document); the diagonal part is k dot products per row; the two are merged by their log-sum-exps.
Nothing of size T x kT is ever built. Inference (`cached_attention`) is plain causal attention over a
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
    row into its documents for plain matmul attention per document (CPU and tests). The dense path skips
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
            out, lse = torch.zeros_like(qd), qd.new_zeros(qd.shape[:2], dtype=torch.float32)
        else:
            out, lse = _dense_causal_attention(qd, kd, vd)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _dense_causal_attention(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """One document: q [L, nh, hd], k/v [L, nkv, hd] -> out [L, nh, hd], lse [L, nh]; fp32 softmax."""
    t, nh, hd = q.shape
    nkv = k.shape[1]
    qg = q.reshape(t, nkv, nh // nkv, hd).permute(1, 2, 0, 3).float()  # [nkv, g, L, hd]
    scores = torch.einsum("ngtd,nsd->ngts", qg, k.transpose(0, 1).float()) / math.sqrt(hd)  # [nkv, g, L, L]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [nkv, g, L]
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("ngts,nsd->ngtd", probs, v.transpose(0, 1).float())  # [nkv, g, L, hd]
    return out.permute(2, 0, 1, 3).reshape(t, nh, hd).to(q.dtype), lse.permute(2, 0, 1).reshape(t, nh)


def ttt_attention(q: Tensor, keys: list[Tensor], values: list[Tensor], mask: DocCausalMask) -> Tensor:
    """Attention of step k = len(keys)-1: q [T, nh, hd]; keys/values of steps 0..k, each [T, nkv, hd]."""
    out0, lse0 = causal_doc_attention(q, keys[0], values[0], mask)
    if len(keys) == 1:
        return out0
    t, nh, hd = q.shape
    nkv = keys[0].shape[1]
    qg = q.reshape(t, nkv, nh // nkv, hd).float()  # [T, nkv, g, hd]
    diag_k = torch.stack(keys[1:], dim=-2).float()  # [T, nkv, k, hd]
    diag_v = torch.stack(values[1:], dim=-2).float()  # [T, nkv, k, hd]
    diag = torch.einsum("tngd,tnjd->tngj", qg, diag_k) / math.sqrt(hd)  # [T, nkv, g, k]
    lse0 = lse0.reshape(t, nkv, nh // nkv, 1)
    total = torch.logsumexp(torch.cat([lse0, diag], dim=-1), dim=-1, keepdim=True)  # [T, nkv, g, 1]
    out = torch.exp(lse0 - total) * out0.reshape(t, nkv, nh // nkv, hd).float()
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
