"""The DFlash proposer: a block drafter proposing up to block_size - 1 tokens per round in one forward.

Per sequence it keeps the drafter's context keys/values (`aerie.draft.dflash.ContextKV`), one entry per
position the target has processed, from the target's captured layers of that position. With committed
tokens x_0..x_{L-1} the target has processed x_0..x_{L-2}, so the context holds positions 0..L-2 and
the block is [x_{L-1}, m, ..., m] at positions L-1..: its slots 1..k are the drafts (argmax over the
target's vocabulary, the drafter's head being the target's). Only verified positions ever enter the
context, so there is nothing to roll back after a rejection.

Sequences are drafted one block each per round (a loop, not a batched forward): the block is one
forward of block_size tokens, and the evaluator's cost is the target's verify forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from aerie.errors import EvaluationError

if TYPE_CHECKING:
    from aerie.draft.dflash import ContextKV, DFlashDrafter


def hidden_state_indices(target_layer_ids: Sequence[int]) -> list[int]:
    """HF `hidden_states` indices (input-of-layer convention) of output-of-layer ids."""
    return [i + 1 for i in target_layer_ids]


class DFlashProposer:
    """`aerie.engine.speculative.decoder.Proposer` drafting blocks with a DFlash drafter."""

    name = "dflash"
    needs_aux = True

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter
        self.caches: dict[int, ContextKV] = {}
        self.last_token: dict[int, int] = {}

    @property
    def aux_layers(self) -> list[int]:
        return hidden_state_indices(self.drafter.config.target_layer_ids)

    @property
    def max_drafts(self) -> int:
        return self.drafter.config.block_size - 1

    def add(self, seqs: Sequence[int], contexts: Sequence[list[int]], aux: Sequence[Tensor] | None) -> None:
        from aerie.draft.dflash import ContextKV

        if aux is None:
            raise EvaluationError("the DFlash proposer needs the target's captured hidden states")
        for seq, context, states in zip(seqs, contexts, aux, strict=True):
            if states.shape[0] != len(context) - 1:
                raise EvaluationError(
                    f"sequence {seq}: {states.shape[0]} aux rows for a context of {len(context)} tokens"
                )
            cache = ContextKV(self.drafter)
            cache.extend(self._checked(seq, states))
            self.caches[seq] = cache
            self.last_token[seq] = int(context[-1])

    def advance(
        self, seqs: Sequence[int], new_tokens: Sequence[list[int]], aux: Sequence[Tensor] | None
    ) -> None:
        if aux is None:
            raise EvaluationError("the DFlash proposer needs the target's captured hidden states")
        for seq, tokens, states in zip(seqs, new_tokens, aux, strict=True):
            if not tokens:
                continue
            # aux row i is the target's state at the position before new_tokens[i]: the context grows
            # by as many positions as tokens were committed.
            self.caches[seq].extend(self._checked(seq, states))
            self.last_token[seq] = int(tokens[-1])

    def remove(self, seqs: Sequence[int]) -> None:
        for seq in seqs:
            self.caches.pop(seq, None)
            self.last_token.pop(seq, None)

    @torch.no_grad()
    def propose(self, seqs: Sequence[int], k: int) -> list[list[int]]:
        k = min(k, self.max_drafts)
        if k < 1:
            return [[] for _ in seqs]
        out = []
        for seq in seqs:
            cache = self.caches[seq]
            logits = self.drafter.draft_block(self.last_token[seq], cache.length, cache)  # [B-1, V]
            out.append([int(t) for t in logits[:k].argmax(dim=-1).tolist()])
        return out

    def _checked(self, seq: int, states: Tensor) -> Tensor:
        width = self.drafter.config.num_context_features * self.drafter.config.hidden_size
        if states.ndim != 2 or states.shape[1] != width:
            raise EvaluationError(
                f"sequence {seq}: aux states {tuple(states.shape)} are not [n, {width}] "
                f"(the drafter reads {self.drafter.config.num_context_features} target layers)"
            )
        return states
