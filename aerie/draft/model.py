"""The EAGLE-3 draft model in one file: the structure and weight names of SGLang's `LlamaForCausalLMEagle3`.

    fc [H, 3H]                       projects the target's three captured hidden states (low, mid, high)
    midlayer                         ONE Llama decoder layer whose q/k/v read 2H:
        input_layernorm [H]              RMSNorm of the token embedding
        hidden_norm [H]                  RMSNorm of the hidden state g
        self_attn.{q,k,v}_proj [*, 2H]   on concat(input_layernorm(embed), hidden_norm(g)); RoPE as the target's
        self_attn.o_proj [H, nh*hd]
        post_attention_layernorm [H]     the residual is the *un-normed* g (SGLang: norm_before_residual=False)
        mlp.{gate,up,down}_proj          SwiGLU
    norm [H]                         final RMSNorm before lm_head
    lm_head [Vd, H]                  logits over the draft vocabulary only
    d2t [Vd] int64, t2d [V] bool     draft id -> target id offsets / membership (see aerie.draft.vocab)

The token embedding is the target's, frozen, and never saved: it is a non-persistent buffer here (SGLang
shares the target's `embed_tokens` through `set_embed`).

Two entry points share the decoder layer and differ only in how attention sees keys:
- `forward` — training-time test (TTT): the layer is unrolled `ttt_length` times over a packed row of
  documents; a query at (step k, row t) sees the step-0 keys at rows <= t of its own document plus the
  diagonal keys at row t of steps 1..k (the visibility a chain of k drafted tokens has at inference).
- `step` — inference: a plain causal KV cache, for chain drafting by the evaluation stage.
The attention functions themselves are in `aerie.draft.attention`.

Reference: SGLang `python/sglang/srt/models/llama_eagle3.py`; SpecForge `modeling/draft/llama3_eagle.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from aerie.draft.attention import DocCausalMask, cached_attention, ttt_attention

# An attention function: (q [T, nh, hd], k [T, nkv, hd], v [T, nkv, hd]) -> out [T, nh, hd]. The decoder layer
# produces post-RoPE q/k/v and hands them to one of these; training and inference differ only here.
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class DraftConfig:
    """Shapes of a drafter: the target's attention geometry, its vocab and the draft vocab."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # V: the target's vocabulary (t2d is [V])
    draft_vocab_size: int  # Vd: rows of lm_head
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    # The target layers whose outputs feed fc, in SGLang's *output-of-layer* convention ([1, N//2-1, N-4]).
    aux_layer_ids: tuple[int, ...] = field(default=(1, 14, 26))

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..{self.vocab_size}")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["aux_layer_ids"] = list(self.aux_layer_ids)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DraftConfig:
        return cls(**{**data, "aux_layer_ids": tuple(data["aux_layer_ids"])})


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, cast back, then scale (the order HF and SGLang use)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """RoPE with the target's theta and scaling (default, linear, llama3, yarn, ... via transformers)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        # A plain attribute, not a buffer: `drafter.to(torch.bfloat16)` must not round the frequencies.
        self.inv_freq, self.attention_scaling = _rope_frequencies(cfg)  # [hd/2] fp32

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [T] -> cos, sin [T, hd] in fp32."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, hd]
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def _rope_frequencies(cfg: DraftConfig) -> tuple[Tensor, float]:
    scaling = dict(cfg.rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim
        return 1.0 / (cfg.rope_theta**exponents), 1.0
    # Scaled variants: reuse transformers' reference formulas so the numbers match the target's own RoPE.
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={**scaling, "rope_type": rope_type, "rope_theta": cfg.rope_theta},
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv_freq.float(), float(factor)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, hd]; cos/sin [T, hd]. The rotate-half convention of HF Llama checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    xf = x.float() * cos[:, None, :] + rotated.float() * sin[:, None, :]
    return xf.to(x.dtype)


class Attention(nn.Module):
    """q/k/v projections that read the 2H concat; the attention itself is supplied by the caller."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)  # [nh*hd, 2H]
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)  # [nkv*hd, 2H]
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)  # [nkv*hd, 2H]
        self.o_proj = nn.Linear(nh * hd, h, bias=False)  # [H, nh*hd]
        self.rotary = Rotary(cfg)

    def forward(self, x: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        """x [T, 2H], positions [T] -> [T, H]."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, nh, hd]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, nkv, hd]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, nkv, hd]
        cos, sin = self.rotary(positions)
        out = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)  # [T, nh, hd]
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)  # [I, H]
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)  # [I, H]
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)  # [H, I]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """SGLang's eagle3 `LlamaDecoderLayer`: attention over concat(norm(embed), norm(g)), residual g."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds: Tensor, g: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        """embeds, g [T, H] -> the layer output [T, H] (pre-norm; fed back as the next step's g)."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(g)], dim=-1)  # [T, 2H]
        r = g + self.self_attn(x, positions, attend)
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Drafter(nn.Module):
    """The drafter. `embed_weight` [V, H] is the target's token embedding (frozen, not saved)."""

    d2t: Tensor
    t2d: Tensor
    embed_weight: Tensor

    def __init__(self, cfg: DraftConfig, embed_weight: Tensor) -> None:
        super().__init__()
        if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"embedding is {tuple(embed_weight.shape)}, the config needs [{cfg.vocab_size}, {cfg.hidden_size}]"
            )
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.hidden_size, cfg.hidden_size, bias=False)  # [H, 3H]
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)  # [Vd, H]
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # [Vd]
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))  # [V]
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)  # [V, H]

    def embed(self, token_ids: Tensor) -> Tensor:
        return F.embedding(token_ids, self.embed_weight)

    def set_vocab(self, d2t: Tensor, t2d: Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocab ids -> target ids (target = draft + d2t[draft], as SGLang's hot_token_id)."""
        return draft_ids + self.d2t[draft_ids]

    def logits(self, out: Tensor) -> Tensor:
        """Layer output [T, H] -> draft logits [T, Vd]."""
        return self.lm_head(self.norm(out))

    def forward(
        self,
        aux_hidden: Tensor,
        input_ids: Tensor,
        positions: Tensor,
        doc_ids: Tensor,
        ttt_length: int,
        attention: str = "dense",
        recompute: bool = False,
    ) -> list[Tensor]:
        """Training-time test over one packed row of T tokens; returns the logits [T, Vd] of each step.

        Row t holds the target features h_t (aux_hidden [T, 3H]). Step k embeds the teacher-forced token
        x_{t+1+k} (input_ids [T] holds x_t at row t, so it is shifted here), uses the previous step's
        output as g (step 0: fc(h_t)), sits at RoPE position positions[t] + k, and predicts the target's
        distribution at t+1+k. Rows whose shifted token falls past their document carry garbage; the
        visibility below keeps it out of valid rows and the loss masks those rows.

        `recompute` (activation checkpointing over the unroll): each step keeps only its inputs and its
        output, key and value, and the backward runs the step again for the rest. A step's activations
        (the 2H concat, q, the MLP's three [T, I] tensors, ...) are several times its [T, H] output, so at
        long rows this trades a third more compute for most of the unroll's memory.
        """
        t = input_ids.shape[0]
        mask = DocCausalMask(doc_ids, attention)
        keys: list[Tensor] = []
        values: list[Tensor] = []
        g = self.fc(aux_hidden)  # [T, H]
        pad = input_ids.new_zeros(ttt_length)
        shifted = torch.cat([input_ids, pad])  # [T + K]
        logits = []
        record = recompute and torch.is_grad_enabled()
        for k in range(ttt_length):
            embeds = self.embed(shifted[1 + k : 1 + k + t]).to(g.dtype)  # x_{t+1+k}: [T, H]
            if record:
                g, key, value = checkpoint(
                    self._ttt_step, embeds, g, positions + k, mask, k, *keys, *values, use_reentrant=False
                )
            else:
                g, key, value = self._ttt_step(embeds, g, positions + k, mask, k, *keys, *values)
            keys.append(key)
            values.append(value)
            logits.append(self.logits(g))  # [T, Vd]
        return logits

    def _ttt_step(
        self, embeds: Tensor, g: Tensor, positions: Tensor, mask: DocCausalMask, k: int, *earlier: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Unroll step k given the keys then values of steps 0..k-1 (`earlier`): (output g, its key, value).
        A pure function of its arguments, so a checkpoint can run it again in the backward."""
        keys, values = list(earlier[:k]), list(earlier[k:])
        new: list[Tensor] = []

        def attend(q: Tensor, key: Tensor, value: Tensor) -> Tensor:
            new.extend((key, value))
            return ttt_attention(q, [*keys, key], [*values, value], mask)

        out = self.midlayer(embeds, g, positions, attend)
        return out, new[0], new[1]

    @torch.no_grad()
    def step(
        self, token_ids: Tensor, hidden: Tensor, positions: Tensor, kv_cache: DraftKVCache
    ) -> tuple[Tensor, Tensor]:
        """One inference forward for chain drafting (one sequence; no batch dimension).

        token_ids [n] int64 target ids; hidden [n, 3H] target features (applies fc) or [n, H] the
        drafter's own previous output; positions [n]. The new keys/values are appended to `kv_cache`
        and each new row attends causally to everything in it. Returns (logits [n, Vd] over the draft
        vocab, next_hidden [n, H] to feed back as `hidden`). Map a draft id to the target with
        `to_target_ids`. Row i pairs the target's features at position p_i with the token at p_i + 1
        and predicts the token after that:
        - extend: after the target has processed x_0..x_{m-1} and chosen y, call with token_ids =
          [x_1..x_{m-1}, y], hidden = its aux states at 0..m-1, positions 0..m-1; the last row drafts d_1;
        - chain: (d_j, next_hidden[-1:], position m-1+j) drafts d_{j+1};
        - after verification accepted d_1..d_k (+ the target's next token z): `kv_cache.crop(m)` drops
          the chain's keys, then extend again with [d_1..d_k, z] and the target's aux states at m..m+k.
        """
        g = self.fc(hidden) if hidden.shape[-1] == 3 * self.config.hidden_size else hidden
        embeds = self.embed(token_ids).to(g.dtype)

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            start = kv_cache.length
            kv_cache.append(k, v)
            return cached_attention(q, *kv_cache.view(), start)

        out = self.midlayer(embeds, g, positions, attend)
        return self.logits(out), out


class DraftKVCache:
    """Keys/values of one sequence for `Eagle3Drafter.step`; `crop` rolls back rejected drafts."""

    def __init__(
        self, cfg: DraftConfig, device: torch.device | str, dtype: torch.dtype, capacity: int = 1024
    ):
        shape = (capacity, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)  # [capacity, nkv, hd]
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> None:
        end = self.length + k.shape[0]
        if end > self.k.shape[0]:  # grow geometrically so appends stay amortised O(1)
            grow = max(end, 2 * self.k.shape[0]) - self.k.shape[0]
            self.k = torch.cat([self.k, self.k.new_empty((grow, *self.k.shape[1:]))])
            self.v = torch.cat([self.v, self.v.new_empty((grow, *self.v.shape[1:]))])
        self.k[self.length : end] = k.to(self.k.dtype)
        self.v[self.length : end] = v.to(self.v.dtype)
        self.length = end

    def view(self) -> tuple[Tensor, Tensor]:
        return self.k[: self.length], self.v[: self.length]

    def crop(self, length: int) -> None:
        """Forget everything after the first `length` positions (the drafts the target rejected)."""
        self.length = min(self.length, length)
