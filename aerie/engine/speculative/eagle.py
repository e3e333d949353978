"""The EAGLE-3 proposer: a trained drafter drafting chains for a batch of sequences.

Per sequence, the drafter's cache holds one entry per committed position t, computed from the pair
(target hidden state at t, token t+1) — its "step 0". A round:

    extend   the pairs the target produced since the last round (prompt at first, then the accepted
             tokens with the target's aux hidden states of their positions): g = fc(aux)
    draft 1  argmax of the last pair's logits (over the draft vocab, mapped to target ids by d2t)
    draft j  (draft j-1, the drafter's own pre-norm output) at the next position, cached as a step entry
    rollback the step entries are cropped before the next extend (they are the cache's last slots in
    every row); only target-verified pairs stay

The drafter's decoder layer is `aerie.draft.model`'s, unchanged; only attention is supplied here, so
that a batch of sequences with different lengths shares one forward: keys live in a [B, S] slot grid
where a row's padding slots are holes a mask hides (as in `aerie.engine.speculative.decoder.TargetCache`).
`Eagle3Drafter.step` (one sequence) is the reference this batched forward is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from aerie.engine.speculative.decoder import compaction_index
from aerie.errors import EvaluationError

if TYPE_CHECKING:
    from aerie.draft.model import DraftConfig, Eagle3Drafter

_COMPACT_FACTOR = 2
_COMPACT_SLACK = 64


def hidden_state_indices(cfg: DraftConfig) -> list[int]:
    """The target hidden states a drafter reads, as HF `hidden_states` indices (input-of-layer
    convention: the drafter config's output-of-layer ids + 1)."""
    return [i + 1 for i in cfg.aux_layer_ids]


class RaggedKV:
    """Keys/values of a batch of sequences in a [B, S] slot grid; `live` marks slots that may be attended.

    Storage grows geometrically (like `DraftKVCache`), so appending one draft step does not copy the
    whole cache."""

    def __init__(
        self, rows: int, kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self._k = torch.empty(rows, 0, kv_heads, head_dim, device=device, dtype=dtype)
        self._v = torch.empty_like(self._k)
        self._live = torch.zeros(rows, 0, dtype=torch.bool, device=device)
        self.length = 0

    @property
    def slots(self) -> int:
        return self.length

    @property
    def k(self) -> Tensor:
        return self._k[:, : self.length]

    @property
    def v(self) -> Tensor:
        return self._v[:, : self.length]

    @property
    def live(self) -> Tensor:
        return self._live[:, : self.length]

    def append(self, k: Tensor, v: Tensor, valid: Tensor) -> None:
        """k/v [B, n, nkv, hd], valid [B, n]."""
        end = self.length + k.shape[1]
        if end > self._k.shape[1]:
            grow = max(end, 2 * self._k.shape[1], 64) - self._k.shape[1]
            b, _, h, d = self._k.shape
            self._k = torch.cat([self._k, self._k.new_empty(b, grow, h, d)], dim=1)
            self._v = torch.cat([self._v, self._v.new_empty(b, grow, h, d)], dim=1)
            self._live = torch.cat([self._live, self._live.new_zeros(b, grow)], dim=1)
        self._k[:, self.length : end] = k.to(self._k.dtype)
        self._v[:, self.length : end] = v.to(self._v.dtype)
        self._live[:, self.length : end] = valid
        self.length = end

    def crop(self, remove: int) -> None:
        if remove > 0:
            self.length -= remove
            self._live[:, self.length :] = False

    def add_rows(self, count: int) -> None:
        """New, empty rows at the end of the batch (all their slots are holes)."""
        b, s, h, d = self._k.shape
        self._k = torch.cat([self._k, self._k.new_zeros(count, s, h, d)])
        self._v = torch.cat([self._v, self._v.new_zeros(count, s, h, d)])
        self._live = torch.cat([self._live, self._live.new_zeros(count, s)])

    def select(self, rows: Tensor) -> None:
        self._k, self._v, self._live = self._k[rows], self._v[rows], self._live[rows]
        self.maybe_compact()

    def maybe_compact(self) -> None:
        """Squeeze the holes out when they dominate (each row's live slots, in order, left-padded)."""
        counts = self.live.sum(dim=1)
        if counts.numel() and self.slots > _COMPACT_FACTOR * int(counts.max()) + _COMPACT_SLACK:
            self.compact()

    def compact(self) -> None:
        index, live = compaction_index(self.live)
        gather = index[:, :, None, None].expand(-1, -1, self._k.shape[2], self._k.shape[3])
        self._k, self._v, self._live = self.k.gather(1, gather), self.v.gather(1, gather), live
        self.length = int(live.shape[1])


class EagleProposer:
    """Chains of top-1 drafts from an EAGLE-3 drafter, for every active sequence in one forward per step."""

    name = "eagle3"
    needs_aux = True

    def __init__(self, drafter: Eagle3Drafter) -> None:
        self.drafter = drafter
        cfg = drafter.config
        self.hidden_size = cfg.hidden_size
        self.kv_heads, self.head_dim = cfg.num_key_value_heads, cfg.head_dim
        param = next(drafter.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cache = RaggedKV(0, self.kv_heads, self.head_dim, self.device, self.dtype)
        self.order: list[int] = []  # cache row -> sequence id
        self.next_position: dict[int, int] = {}  # sequence -> position of its next step-0 pair
        self.pending: dict[int, tuple[list[int], list[Tensor]]] = {}  # pairs not yet in the cache
        self.step_slots = 0  # trailing slots holding the last round's draft steps

    @property
    def aux_layers(self) -> list[int]:
        return hidden_state_indices(self.drafter.config)

    # -- Proposer protocol -------------------------------------------------------------------------

    def add(self, seqs: Sequence[int], contexts: Sequence[list[int]], aux: Sequence[Tensor] | None) -> None:
        if aux is None:
            raise EvaluationError("the EAGLE-3 proposer needs the target's aux hidden states")
        self.cache.add_rows(len(seqs))
        for seq, context, states in zip(seqs, contexts, aux, strict=True):
            if states.shape[0] != len(context) - 1:
                raise EvaluationError(
                    f"sequence {seq}: {states.shape[0]} aux rows for a context of {len(context)} tokens"
                )
            self.order.append(seq)
            self.next_position[seq] = 0
            self.pending[seq] = (list(context[1:]), [states])

    def advance(
        self, seqs: Sequence[int], new_tokens: Sequence[list[int]], aux: Sequence[Tensor] | None
    ) -> None:
        if aux is None:
            raise EvaluationError("the EAGLE-3 proposer needs the target's aux hidden states")
        for seq, tokens, states in zip(seqs, new_tokens, aux, strict=True):
            pending_tokens, pending_aux = self.pending.setdefault(seq, ([], []))
            pending_tokens.extend(tokens)
            pending_aux.append(states)

    def remove(self, seqs: Sequence[int]) -> None:
        gone = set(seqs)
        keep = [i for i, seq in enumerate(self.order) if seq not in gone]
        self.cache.select(torch.tensor(keep, dtype=torch.long, device=self.device))
        self.order = [self.order[i] for i in keep]
        for seq in gone:
            self.next_position.pop(seq, None)
            self.pending.pop(seq, None)

    @torch.no_grad()
    def propose(self, seqs: Sequence[int], k: int) -> list[list[int]]:
        if k < 1:
            return [[] for _ in seqs]
        asked = set(seqs)
        self.cache.crop(self.step_slots)
        self.step_slots = 0
        self.cache.maybe_compact()
        logits, hidden, last = self._extend()
        rows = [i for i, seq in enumerate(self.order) if seq in asked]
        missing = [self.order[i] for i in rows if last[i] < 0]
        if missing:
            raise EvaluationError(f"sequences {missing} have nothing to draft from (no verified tokens)")
        index = torch.arange(len(self.order), device=self.device)
        last_t = torch.tensor([max(i, 0) for i in last], device=self.device)
        step_logits, g = logits[index, last_t], hidden[index, last_t]  # [B, Vd], [B, H]
        drafts = [self._to_target(step_logits)]
        valid = torch.zeros(len(self.order), 1, dtype=torch.bool, device=self.device)
        valid[rows] = True
        base = torch.tensor([self.next_position.get(seq, 0) for seq in self.order], device=self.device)
        for j in range(1, k):
            step_logits, g = self._forward(drafts[-1][:, None], g[:, None], (base + j - 1)[:, None], valid)
            step_logits, g = step_logits[:, 0], g[:, 0]
            drafts.append(self._to_target(step_logits))
            self.step_slots += 1
        chains = torch.stack(drafts, dim=1).tolist()  # [B, k]
        by_seq = {self.order[i]: chains[i] for i in rows}
        return [[int(t) for t in by_seq[seq]] for seq in seqs]

    # -- internals ---------------------------------------------------------------------------------

    def _to_target(self, logits: Tensor) -> Tensor:
        return self.drafter.to_target_ids(logits.argmax(dim=-1))

    def _extend(self) -> tuple[Tensor, Tensor, list[int]]:
        """Put every row's pending pairs into the cache in one forward. Returns logits [B, n, Vd],
        outputs [B, n, H] and, per row, the index of its last new pair (-1 if it had none)."""
        b = len(self.order)
        lengths = [len(self.pending.get(seq, ([], []))[0]) for seq in self.order]
        width = max(lengths, default=0)
        if width == 0:
            raise EvaluationError("nothing to draft from: no sequence has verified tokens pending")
        aux_width = len(self.drafter.config.aux_layer_ids) * self.hidden_size
        tokens = torch.zeros(b, width, dtype=torch.long, device=self.device)
        states = torch.zeros(b, width, aux_width, dtype=self.dtype, device=self.device)
        positions = torch.zeros(b, width, dtype=torch.long, device=self.device)
        valid = torch.zeros(b, width, dtype=torch.bool, device=self.device)
        for i, seq in enumerate(self.order):
            n = lengths[i]
            if n == 0:
                continue
            pending_tokens, pending_aux = self.pending.pop(seq)
            stacked = torch.cat(pending_aux)
            if stacked.shape != (n, aux_width):
                raise EvaluationError(
                    f"sequence {seq}: aux states {tuple(stacked.shape)} do not pair with {n} tokens of width "
                    f"{aux_width} (the drafter reads {len(self.drafter.config.aux_layer_ids)} target layers)"
                )
            tokens[i, :n] = torch.tensor(pending_tokens, device=self.device)
            states[i, :n] = stacked.to(device=self.device, dtype=self.dtype)
            start = self.next_position[seq]
            positions[i] = start + torch.arange(width, device=self.device).clamp(max=n - 1)
            valid[i, :n] = True
            self.next_position[seq] = start + n
        logits, hidden = self._forward(tokens, states, positions, valid)
        return logits, hidden, [n - 1 for n in lengths]

    def _forward(
        self, tokens: Tensor, hidden: Tensor, positions: Tensor, valid: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The drafter on a [B, n] grid (hidden [B, n, 3H] target features or [B, n, H] own outputs);
        new keys go into the cache, `valid` marks which are real. Returns logits [B, n, Vd], out [B, n, H]."""
        d = self.drafter
        b, n = tokens.shape
        flat = hidden.reshape(b * n, hidden.shape[-1])
        g = d.fc(flat) if flat.shape[-1] != self.hidden_size else flat
        embeds = d.embed(tokens.reshape(-1)).to(g.dtype)
        cache = self.cache

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            start = cache.slots
            cache.append(
                k.view(b, n, self.kv_heads, self.head_dim), v.view(b, n, self.kv_heads, self.head_dim), valid
            )
            slots = torch.arange(cache.slots, device=q.device)
            query_slots = start + torch.arange(n, device=q.device)
            causal = slots[None, :] <= query_slots[:, None]  # [n, S]
            visible = (cache.live[:, None, :] & causal[None]) | (slots[None, :] == query_slots[:, None])[None]
            out = F.scaled_dot_product_attention(
                q.view(b, n, -1, self.head_dim).transpose(1, 2),  # [B, nh, n, hd]
                cache.k.transpose(1, 2),  # [B, nkv, S, hd]
                cache.v.transpose(1, 2),
                attn_mask=visible[:, None],  # [B, 1, n, S]
                enable_gqa=True,
            )
            return out.transpose(1, 2).reshape(b * n, -1, self.head_dim)

        out = d.midlayer(embeds, g, positions.reshape(-1), attend)  # [B*n, H]
        return d.logits(out).view(b, n, -1), out.view(b, n, -1)
