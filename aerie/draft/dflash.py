"""The DFlash block drafter: the structure and weight names of SGLang's `DFlashDraftModel`.

    fc [H, kH]                        projects the k captured target layers of each context position
    hidden_norm [H]                   RMSNorm after fc: the context feature c_t
    layers.i (num_layers of them), Qwen3-style decoder layers:
        input_layernorm [H]               on the block's hidden states (never on the context features)
        self_attn.{q,k,v}_proj [*, H]     q from the block; k/v from the context features AND the block
        self_attn.{q,k}_norm [hd]         per-head RMSNorm of q and k, then RoPE (rotate-half)
        self_attn.o_proj [H, nh*hd]
        post_attention_layernorm [H], mlp.{gate,up,down}_proj (SwiGLU)
    norm [H]                          final RMSNorm; the logits are the *target's* lm_head on it

No embedding and no lm_head are saved: both are the target's (frozen; SGLang shares them).

A block after anchor position a is [x_a, m, m, ..., m] (block_size tokens, m = the mask token) at RoPE
positions a..a+B-1. Every block token attends to the context features of positions < a (their keys and
values from each layer's k/v projections of c_t) and to all B block tokens (no causal mask inside the
block: the drafted positions are predicted together). The output at block slot j >= 1 predicts x_{a+j},
so one forward drafts B-1 tokens.

- `forward` (training): many anchors of one packed row at once; a block sees the context of its own
  document only.
- `draft_block` (inference): one block of one sequence against its cached context keys/values
  (`ContextKV`, extended as the target verifies tokens).

Reference: SGLang `python/sglang/srt/models/dflash.py` and `speculative/dflash_utils.py`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aerie.draft.model import MLP, DraftConfig, RMSNorm, Rotary, apply_rope

# The fields a DFlash drafter shares with EAGLE-3's `DraftConfig`: the target's attention geometry,
# vocabulary and RoPE.
GEOMETRY = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
)  # fmt: skip


@dataclass(frozen=True)
class DFlashConfig:
    """Shapes of a DFlash drafter: the target's attention geometry, the block and the captured layers."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    mask_token_id: int
    num_target_layers: int  # depth of the target (SGLang validates the layer ids against it)
    target_layer_ids: tuple[int, ...] = field(default=(1, 8, 14, 21, 27))  # output-of-layer convention
    block_size: int = 8
    num_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary 0..{self.vocab_size - 1}"
            )
        if self.block_size < 2:
            raise ValueError(f"block_size {self.block_size} drafts nothing (the anchor takes one slot)")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad or not self.target_layer_ids:
            raise ValueError(
                f"target_layer_ids {list(self.target_layer_ids)} out of 0..{self.num_target_layers - 1}"
            )

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids)

    def rope(self) -> DraftConfig:
        """The same RoPE as the target's (EAGLE-3's `Rotary` and `MLP` read these fields of a `DraftConfig`)."""
        return DraftConfig(
            **{name: getattr(self, name) for name in GEOMETRY}, draft_vocab_size=self.vocab_size
        )

    @classmethod
    def of(cls, geometry: DraftConfig, **block: Any) -> DFlashConfig:
        """The `GEOMETRY` of an EAGLE-3 config (`aerie.draft.export.draft_config_for`: the target's,
        taken from its `TargetInfo` once) with the block fields."""
        return cls(**{name: getattr(geometry, name) for name in GEOMETRY}, **block)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["target_layer_ids"] = list(self.target_layer_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DFlashConfig:
        return cls(**{**data, "target_layer_ids": tuple(data["target_layer_ids"])})


class DFlashAttention(nn.Module):
    """q from the block; k/v from the context features and the block; Qwen3's per-head q/k norms."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.rope())

    def keys_values(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """x [n, H] (context features or the normed block), positions [n] -> k, v [n, nkv, hd] (k roped)."""
        n = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        cos, sin = self.rotary(positions)
        return apply_rope(k, cos, sin), v

    def query(self, x: Tensor, positions: Tensor) -> Tensor:
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim))
        cos, sin = self.rotary(positions)
        return apply_rope(q, cos, sin)

    def forward(
        self, x: Tensor, positions: Tensor, ctx_k: Tensor, ctx_v: Tensor, visible: Tensor | None
    ) -> Tensor:
        """Block x [n, H] at positions [n]; ctx_k/v [m, nkv, hd]; visible [n, m + n] bool, or None for
        all. Returns [n, H]."""
        n = x.shape[0]
        q = self.query(x, positions)
        k, v = self.keys_values(x, positions)
        keys, values = torch.cat([ctx_k, k.to(ctx_k.dtype)]), torch.cat([ctx_v, v.to(ctx_v.dtype)])
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None].to(q.dtype),
            values.transpose(0, 1)[None].to(q.dtype),
            attn_mask=None if visible is None else visible[None, None],
            enable_gqa=True,
        )  # [1, nh, n, hd]
        return self.o_proj(out[0].transpose(0, 1).reshape(n, -1))


class DFlashLayer(nn.Module):
    """Pre-norm decoder layer; the context features enter only as keys/values."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.rope())

    def forward(
        self, x: Tensor, positions: Tensor, ctx_k: Tensor, ctx_v: Tensor, visible: Tensor | None
    ) -> Tensor:
        r = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, visible)
        return r + self.mlp(self.post_attention_layernorm(r))


class DFlashDrafter(nn.Module):
    """The drafter. `embed_weight` [V, H] and `head_weight` [V, H] are the target's (frozen, not saved)."""

    embed_weight: Tensor
    head_weight: Tensor

    def __init__(self, cfg: DFlashConfig, embed_weight: Tensor, head_weight: Tensor) -> None:
        super().__init__()
        for name, w in (("embedding", embed_weight), ("lm_head", head_weight)):
            if tuple(w.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise ValueError(
                    f"{name} is {tuple(w.shape)}, the config needs [{cfg.vocab_size}, {cfg.hidden_size}]"
                )
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_context_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("head_weight", head_weight.detach(), persistent=False)

    @property
    def decoder_layers(self) -> list[DFlashLayer]:
        return [cast(DFlashLayer, layer) for layer in self.layers]

    def context(self, aux_hidden: Tensor) -> Tensor:
        """Captured target layers [n, kH] -> context features [n, H]."""
        return self.hidden_norm(self.fc(aux_hidden))

    def block_tokens(self, anchors: Tensor) -> Tensor:
        """Anchor token ids [A] -> block ids [A, B]: the anchor, then mask tokens."""
        cfg = self.config
        ids = torch.full(
            (anchors.shape[0], cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=anchors.device
        )
        ids[:, 0] = anchors
        return ids

    def logits(self, out: Tensor) -> Tensor:
        """Block outputs [n, H] -> target-vocabulary logits [n, V] (the target's own head)."""
        return F.linear(self.norm(out), self.head_weight.to(out.dtype))

    def _layers(
        self, x: Tensor, positions: Tensor, ctx: Tensor, ctx_positions: Tensor, visible: Tensor | None
    ) -> Tensor:
        for layer in self.decoder_layers:
            ctx_k, ctx_v = layer.self_attn.keys_values(ctx, ctx_positions)
            x = layer(x, positions, ctx_k, ctx_v, visible)
        return x

    def forward(
        self, aux_hidden: Tensor, input_ids: Tensor, positions: Tensor, doc_ids: Tensor, anchors: Tensor
    ) -> Tensor:
        """Blocks after `anchors` [A] (row indices) of one packed row of T tokens -> outputs [A, B, H].

        Row t holds the target features of position t (aux_hidden [T, kH]) and token x_t (input_ids).
        The block of anchor a sees the context rows s < a of a's document, and its own B tokens."""
        cfg = self.config
        a, b = anchors.shape[0], cfg.block_size
        ctx = self.context(aux_hidden)  # [T, H]
        ids = self.block_tokens(input_ids[anchors])  # [A, B]
        x = F.embedding(ids.reshape(-1), self.embed_weight).to(ctx.dtype)  # [A*B, H]
        block_positions = (positions[anchors][:, None] + torch.arange(b, device=anchors.device)).reshape(-1)
        visible = block_visibility(anchors, doc_ids, b)
        out = self._layers(x, block_positions, ctx, positions, visible)
        return out.view(a, b, -1)

    @torch.no_grad()
    def draft_block(self, anchor_token: int, position: int, cache: ContextKV) -> Tensor:
        """One block at `position` (the anchor's) after the context in `cache` -> logits [B-1, V] of
        positions position+1 .. position+B-1."""
        b = self.config.block_size
        device = self.embed_weight.device
        ids = self.block_tokens(torch.tensor([anchor_token], device=device))[0]
        x = F.embedding(ids, self.embed_weight).to(self.fc.weight.dtype)
        positions = position + torch.arange(b, device=device)
        for layer, (ctx_k, ctx_v) in zip(self.decoder_layers, cache.view(), strict=True):
            x = layer(x, positions, ctx_k, ctx_v, None)
        return self.logits(x[1:])


def block_visibility(anchors: Tensor, doc_ids: Tensor, block_size: int) -> Tensor:
    """[A*B, T + A*B] bool: a block token sees context rows s < anchor of the anchor's document, and
    every token of its own block."""
    t, a = doc_ids.shape[0], anchors.shape[0]
    rows = torch.arange(t, device=anchors.device)
    ctx = (rows[None, :] < anchors[:, None]) & (doc_ids[None, :] == doc_ids[anchors][:, None])  # [A, T]
    block = torch.arange(a, device=anchors.device)
    own = block[:, None] == block[None, :]  # [A, A]
    per_block = torch.cat([ctx, own.repeat_interleave(block_size, dim=1)], dim=1)  # [A, T + A*B]
    return per_block.repeat_interleave(block_size, dim=0)


class ContextKV:
    """One sequence's context keys/values per draft layer, extended as the target verifies tokens."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter
        param = drafter.fc.weight
        cfg = drafter.config
        empty = param.new_zeros(0, cfg.num_key_value_heads, cfg.head_dim)
        self.k: list[Tensor] = [empty for _ in drafter.layers]
        self.v: list[Tensor] = [empty for _ in drafter.layers]
        self.length = 0

    @torch.no_grad()
    def extend(self, aux_hidden: Tensor) -> None:
        """Append the target features [n, kH] of positions length .. length+n-1."""
        n = aux_hidden.shape[0]
        if n == 0:
            return
        param = self.drafter.fc.weight
        ctx = self.drafter.context(aux_hidden.to(param.device, param.dtype))
        positions = torch.arange(self.length, self.length + n, device=param.device)
        for i, layer in enumerate(self.drafter.decoder_layers):
            k, v = layer.self_attn.keys_values(ctx, positions)
            self.k[i], self.v[i] = torch.cat([self.k[i], k]), torch.cat([self.v[i], v])
        self.length += n

    def view(self) -> list[tuple[Tensor, Tensor]]:
        return list(zip(self.k, self.v, strict=True))
