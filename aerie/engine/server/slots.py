"""Slot decoding: a KV cache allocated once, one row per running request, for Llama-family targets.

Why it exists: `BatchedDecoder` keeps transformers' DynamicCache, which copies every layer's whole
cache when a request joins (left pad + concatenate) or leaves (index select), and grows it by
concatenation at every step. (The `smollm2-gpu` preset's generation on an H200, ~1.5K tokens/s, was mostly lost
to cuDNN attention plans, since kept off: `aerie.targets.avoid_cudnn_attention`; the copies and the
per-admission cost came next.) Here:

- each layer owns K/V buffers `[rows, kv_heads, length, head_dim]`, grown by doubling (rarely);
- a running request owns a row, and the running rows are always `0..B-1`: when requests finish,
  the survivors beyond the new end move into the holes (only those rows are copied), so attention
  reads a view of the buffers and never a gathered copy;
- joining requests are prefilled together in ONE packed forward (no padding; segment-causal
  attention from `aerie.engine.server.packed`, the same kernels as extraction) whose K/V are scattered
  straight into their rows;
- a decoding step writes each row's new K/V at that row's own position and attends over
  `[:B, :, :longest]` with a per-row length mask (grouped-query heads are batched, not repeated).

The layer code follows the Llama layout (input_layernorm -> self_attn.{q,k,v,o}_proj with the
model's own rotary embedding -> post_attention_layernorm -> mlp), with Qwen3's per-head q/k norms
when present; `supports(model)` says whether a model qualifies, and the server falls back to
`BatchedDecoder` otherwise. Sampling and stop rules are BatchedDecoder's own (inherited), so greedy
outputs agree token for token (tested in float32 on SmolLM2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from aerie.engine.generation import BatchedDecoder, GenRequest, GenResult
from aerie.engine.server import faults, packed
from aerie.engine.server.decode_graphs import CudaGraphRunner, DecodeGraphs
from aerie.engine.server.sglang_log import logger

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
LENGTH_QUANTUM = 256  # cache length grows in multiples of this, at least doubling

# attend(layer index, q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]) -> [N, Hq * D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# cuda: decoding steps replayed as CUDA graphs (aerie.engine.server.decode_graphs); static: the same
# static-shape step run eagerly (the CPU tests)
GraphMode = Literal["off", "static", "cuda"]


def supports(model: PreTrainedModel) -> bool:
    """Whether `SlotDecoder` can run this model (Llama-like layers, no sliding window)."""
    cfg = model.config
    if getattr(cfg, "model_type", "") not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return False
    layers = getattr(model.base_model, "layers", None)
    return isinstance(layers, torch.nn.ModuleList) and all(
        hasattr(layer, "self_attn") and hasattr(layer.self_attn, "q_proj") for layer in layers
    )


class KVSlots:
    """Per-layer K/V buffers `[rows, kv_heads, length, head_dim]`; grow only, by doubling."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
        max_length: int | None = None,
    ):
        """`max_length` (the model's context): doubling stops there. The buffers are rows x length, so
        doubling past the context asks for memory no request can use (512 rows of SmolLM2 at 16,384
        positions are 193 GB, at its 8,192 half that); a longer request still grows them to its length."""
        self.shape = (kv_heads, head_dim)
        self.max_length = max_length
        self.capacity: int | None = None  # cells (rows x length) doubling may not go past
        self.failed_cells = 0  # the size of the last allocation that failed (0: none)
        self.dtype, self.device = dtype, device
        self.rows = self.length = 0
        self.version = 0  # bumped whenever the buffers are reallocated (captured graphs hold pointers)
        self.k: list[torch.Tensor] = [torch.empty(0) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = [torch.empty(0) for _ in range(num_layers)]

    def ensure(self, rows: int, length: int) -> None:
        if rows <= self.rows and length <= self.length:
            return
        new_rows = max(rows, self.rows)
        new_length = self.length
        if length > self.length:
            doubled = 2 * self.length
            if self.max_length is not None:
                doubled = min(doubled, self.max_length)
            if self.capacity is not None:  # doubling stops at the budget too
                doubled = min(doubled, self.capacity // new_rows // LENGTH_QUANTUM * LENGTH_QUANTUM)
            new_length = max(-(-length // LENGTH_QUANTUM) * LENGTH_QUANTUM, doubled)
        heads, dim = self.shape
        try:
            for store in (self.k, self.v):
                for i, old in enumerate(store):
                    faults.hit("kv_alloc")
                    new = torch.zeros(new_rows, heads, new_length, dim, dtype=self.dtype, device=self.device)
                    if old.numel():
                        new[: self.rows, :, : self.length] = old
                    store[i] = new
        except BaseException:
            # Some layers hold new buffers, the others old ones, and a captured graph may still point
            # at the old buffers just freed: keep nothing (the version bump drops the graphs).
            self.release()
            self.failed_cells = new_rows * new_length
            raise
        self.rows, self.length = new_rows, new_length
        self.version += 1

    def release(self) -> None:
        """Drop every buffer (their memory goes back to the allocator); the next `ensure` starts anew."""
        self.k = [torch.empty(0) for _ in self.k]
        self.v = [torch.empty(0) for _ in self.v]
        self.rows = self.length = 0
        self.version += 1

    def move(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy rows `src` into rows `dst` (disjoint), the first `length` positions."""
        for store in (self.k, self.v):
            for buf in store:
                buf[dst, :, :length] = buf[src, :, :length]


class SlotDecoder(BatchedDecoder):
    """`GenerationBackend` with a row-slotted KV cache; see the module docstring."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None,
        *,
        graphs: GraphMode = "off",
        capacity: int | None = None,
        **decoder_args: Any,
    ) -> None:
        """`decoder_args` are BatchedDecoder's (eos_token_ids, device, max_running, ...); `capacity`:
        the cells (rows x positions) the cache may hold (`aerie.engine.server.memory`), None for no
        limit. Admission keeps the cache within it."""
        super().__init__(model, tokenizer, **decoder_args)
        self.capacity = capacity
        self.plan: Any = None  # the memory plan it was sized by (set by the server; for /server_info)
        self._admitting_need = 0  # the longest need among the requests admitted in this round
        device, max_running = self.device, self.max_running
        cfg = model.config
        self.base: Any = model.base_model  # a Llama-like decoder stack (checked by supports)
        self.num_heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        dtype = next(model.parameters()).dtype
        layers: Any = self.base.layers
        context = getattr(cfg, "max_position_embeddings", None)
        self.kv = KVSlots(len(layers), self.kv_heads, self.head_dim, dtype, device, max_length=context)
        self.kv.capacity = capacity
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)  # tokens cached per running row
        self.admit_when_free = max(1, max_running // 8)
        self.context = int(context) if context else None
        self.graph_mode = graphs
        self.graphs: DecodeGraphs | None = self._make_graphs() if graphs != "off" else None

    def _make_graphs(self) -> DecodeGraphs:
        head: Any = self.model.lm_head.weight  # the logits' size and dtype, for the static output
        return DecodeGraphs(
            self._decode_logits,
            self.kv,
            self.max_running,
            vocab=int(head.shape[0]),
            dtype=head.dtype,
            runner=CudaGraphRunner() if self.graph_mode == "cuda" else None,
            quantum=LENGTH_QUANTUM,
        )

    def can_admit(self, request: GenRequest, admitting: int, admitting_tokens: int) -> bool:
        if not admitting:
            self._admitting_need = 0
        free = self.max_running - self.num_running
        if admitting >= free:
            return False
        # A prefill costs about one decoding step of kernel launches whatever its size (measured on an
        # H200: admitting one request per step halved the tokens/s), so a running batch takes newcomers
        # only once an eighth of its rows is free.
        if not admitting and self.num_running and free < self.admit_when_free:
            return False
        if admitting and admitting_tokens + len(request.input_ids) > self.max_prefill_tokens:
            return False
        if not self._fits(request, admitting):
            return False
        self._admitting_need = max(self._admitting_need, self._need(request))
        return True

    def refusal(self, request: GenRequest) -> str | None:
        """Why the cache could never hold `request` (even alone), or None when it can."""
        if self.capacity is None:
            return None
        rows = self.max_running if self.graphs is not None and not self.graphs.disabled else 1
        need = self._need(request)
        if rows * need <= self.capacity:
            return None
        return (
            f"the request may reach {need:,} positions ({len(request.input_ids):,} prompt tokens + "
            f"max_new_tokens {request.params.max_new_tokens:,}); the KV cache holds {self.capacity:,} cells "
            f"for {rows} row(s) (--max-total-tokens / --mem-fraction-static size it): lower max_new_tokens"
        )

    def release_memory(self) -> None:
        """After an allocation failed: drop the running rows, the KV buffers and the captured graphs
        (which point into those buffers and their own pool), and hand the memory back, so nothing is
        left pointing at freed memory. Graphs are captured again on the next step."""
        attempted = self.kv.failed_cells or self.kv.rows * self.kv.length
        self.abort_all()
        self.kv.release()
        self.kv.failed_cells = 0
        if self.graphs is not None:
            self.graphs.drop()
        if str(self.device).startswith("cuda"):
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self._shrink(attempted)

    def _shrink(self, attempted: int) -> None:
        """The device could not hold `attempted` cells (with whatever else it held): a quarter less is
        the budget from now on; with CUDA graphs the running batch is lowered to fit it at the full
        context (the graphs are made again for the smaller batch). Repeated failures shrink it geometrically, never below one row."""
        if attempted <= 0:
            return
        capacity = attempted * 3 // 4 if self.capacity is None else min(self.capacity, attempted * 3 // 4)
        self.capacity = self.kv.capacity = capacity
        positions = -(-(self.context or self.kv.length or LENGTH_QUANTUM) // LENGTH_QUANTUM) * LENGTH_QUANTUM
        graphs = self.graphs is not None and not self.graphs.disabled
        # Eager rows are allocated as requests join (admission waits for room); graph steps run them all.
        running = max(1, min(self.max_running, capacity // positions)) if graphs else self.max_running
        logger.warning(
            f"KV cache budget lowered to {capacity:,} cells after an allocation of {attempted:,} failed; "
            f"max_running_requests {self.max_running} -> {running}"
        )
        if running != self.max_running:
            self.max_running = running
            self.admit_when_free = max(1, running // 8)
            if self.graphs is not None and not self.graphs.disabled:
                self.graphs = self._make_graphs()

    def _need(self, request: GenRequest) -> int:
        """The positions a request's row may reach, as the cache rounds them."""
        need = len(request.input_ids) + max(1, request.params.max_new_tokens)
        if self.context is not None:
            need = min(need, self.context)
        return -(-need // LENGTH_QUANTUM) * LENGTH_QUANTUM

    def _fits(self, request: GenRequest, admitting: int) -> bool:
        """Whether the cache stays within its capacity with `request` admitted too."""
        if self.capacity is None:
            return True
        longest = max(
            [self._admitting_need, self._need(request), *(self._need(r.request) for r in self.rows)]
        )
        graphs = self.graphs is not None and not self.graphs.disabled
        rows = self.max_running if graphs else max(self.kv.rows, self.num_running + admitting + 1)
        if rows * max(longest, self.kv.length) <= self.capacity:
            return True
        if not (self.rows or admitting or graphs) and self.kv.rows:
            # Idle, with buffers shaped for an earlier batch: start them anew at the shape needed now.
            self.kv.release()
            return (admitting + 1) * longest <= self.capacity
        return False

    def admit(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        if not requests:
            return []
        first = len(self.rows)
        prompts = [r.input_ids for r in requests]
        pack = packed.make_pack(prompts, self.device)
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device)
        self.kv.ensure(first + len(prompts), pack.max_len + 1)
        rows = torch.arange(first, first + len(prompts), device=self.device).repeat_interleave(lengths)
        positions = pack.position_ids[0]
        hidden = self._forward(pack.input_ids[0], positions, rows, self._packed_attend(pack))
        last = pack.cu_seqlens[1:].long() - 1
        logits = self.model.lm_head(hidden[last])
        new_rows = [self._new_row(r) for r in requests]
        tokens = self._sample(logits, new_rows)
        self.rows.extend(new_rows)
        self.lengths = torch.cat([self.lengths[:first], lengths])
        self.next_ids = tokens if self.next_ids is None else torch.cat([self.next_ids[:first], tokens])
        return self._record(tokens, first)

    def step(self) -> list[GenResult]:
        if not self.rows:
            return []
        assert self.next_ids is not None
        n = len(self.rows)
        width = int(self.lengths.max()) + 1  # one sync per step; _record needs the tokens anyway
        logits = self.graphs.logits(self.next_ids, self.lengths, width) if self.graphs is not None else None
        if logits is None:
            self.kv.ensure(n, width)
            rows = torch.arange(n, device=self.device)
            logits = self._decode_logits(self.next_ids, self.lengths.clone(), rows, width)
        self.lengths += 1
        tokens = self._sample(logits, self.rows)
        self.next_ids = tokens
        return self._record(tokens, 0)

    def abort_all(self) -> list[GenRequest]:
        dropped = [r.request for r in self.rows]
        self.rows, self.next_ids = [], None
        self.lengths = self.lengths[:0]
        return dropped

    # -- internals -------------------------------------------------------------------------------

    def _keep_rows(self, keep: list[int]) -> None:
        """Survivors beyond the new end fill the holes left below it; no other row moves."""
        n = len(keep)
        kept = set(keep)
        holes = [i for i in range(n) if i not in kept]
        movers = [i for i in keep if i >= n]
        if holes:
            width = int(self.lengths[movers].max())
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(holes, device=self.device)
            self.kv.move(src, dst, width)
            self.lengths[dst] = self.lengths[src]
            assert self.next_ids is not None
            self.next_ids[dst] = self.next_ids[src]
            for h, m in zip(holes, movers, strict=True):
                self.rows[h] = self.rows[m]
        self.rows = self.rows[:n]
        self.lengths = self.lengths[:n]
        self.next_ids = self.next_ids[:n] if n and self.next_ids is not None else None

    def _decode_logits(
        self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, width: int
    ) -> torch.Tensor:
        """Logits of one token per row in `rows` (`ids` at `positions`) over cache width `width`:
        the decoding forward, eager or as DecodeGraphs captures it."""
        hidden = self._forward(ids, positions, rows, self._decode_attend(positions, width))
        logits: torch.Tensor = self.model.lm_head(hidden)
        return logits

    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Final-norm hidden states [N, H] of N tokens; each token's K/V lands in (row, position)."""
        n = ids.shape[0]
        x = self.base.embed_tokens(ids)[None]  # [1, N, H]: the shape the norms and rotary expect
        cos, sin = self.base.rotary_emb(x, positions[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [N, 1, D] against [N, heads, D]
        for i, layer in enumerate(self.base.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)[0]
            q = attn.q_proj(h).view(n, self.num_heads, self.head_dim)
            k = attn.k_proj(h).view(n, self.kv_heads, self.head_dim)
            v = attn.v_proj(h).view(n, self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: RMS norm per head before the rotation
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            self.kv.k[i][rows, :, positions] = k
            self.kv.v[i][rows, :, positions] = v
            x = x + attn.o_proj(attend(i, q, k, v))[None]
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        out: torch.Tensor = self.base.norm(x)[0]
        return out

    def _scaling(self) -> float:
        return float(getattr(self.base.layers[0].self_attn, "scaling", self.head_dim**-0.5))

    def _packed_attend(self, pack: packed.Pack) -> Attend:
        scaling = self._scaling()

        def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            query, key, value = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, N, D]
            out, _unused = packed.packed_attention_forward(
                self.base.layers[0].self_attn,
                query,
                key,
                value,
                None,
                scaling=scaling,
                cu_seq_lens_q=pack.cu_seqlens,
                max_length_q=pack.max_len,
            )
            return out[0].reshape(q.shape[0], -1)

        return attend

    def _decode_attend(self, positions: torch.Tensor, width: int) -> Attend:
        """One query per row (at `positions`) against its row's cache: grouped heads as a batched
        matmul, no K/V copy."""
        scaling = self._scaling()
        groups = self.num_heads // self.kv_heads
        n = positions.shape[0]
        visible = torch.arange(width, device=self.device)[None, :] <= positions[:, None]  # [B, W]
        bias = torch.zeros(visible.shape, dtype=torch.float32, device=self.device)
        bias = bias.masked_fill(~visible, float("-inf"))[:, None, None, :]  # [B, 1, 1, W]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys = self.kv.k[i][:n, :, :width]  # [B, Hkv, W, D], a view
            values = self.kv.v[i][:n, :, :width]
            query = q.view(n, self.kv_heads, groups, self.head_dim)
            scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scaling + bias
            probs = scores.softmax(dim=-1).to(values.dtype)
            return torch.matmul(probs, values).reshape(n, -1)  # [B, Hkv, G, D] -> [B, Hq * D]

        return attend


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half convention transformers' Llama uses."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
