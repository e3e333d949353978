"""Lossless speculative decoding with the target in transformers: greedy, or sampled at a temperature.

One round, per sequence (committed tokens x_0..x_{L-1}; the target's KV cache holds x_0..x_{L-2}):

    proposer  drafts a chain d_1..d_k (top-1)                         EAGLE-3 drafter, prompt lookup, ...
    target    ONE forward over [x_{L-1}, d_1..d_k] (k+1 tokens)       logits t_0..t_k, aux hidden states
    accept    the longest prefix with d_j == t_{j-1}, then the target's own next token t_a (the bonus)
    rollback  the KV entries of rejected drafts are dropped           (DynamicCache.crop / masked out)

Every emitted token is the target's argmax given the tokens before it, so at temperature 0 the output
is the target's plain greedy output whatever the proposer proposes; the proposer only decides how many
tokens one target forward yields (the acceptance length).

At a temperature T > 0 the drafts are verified by the rejection rule of speculative sampling for a
proposer that drafts one token per position (a point mass, as SGLang's EAGLE-3 chain drafts): with p the
target's distribution at T after the context and the accepted drafts, draft d is accepted with
probability p(d); on rejection the token is drawn from p with d removed and renormalised, and the chain
stops. Each emitted token is then distributed exactly as p, whatever the proposer drafts:
P(x) = p(d)[x = d] + (1 - p(d)) p(x)[x != d] / (1 - p(d)) = p(x). `accept_sampled` is that rule.

Sequences are decoded as a batch although each accepts a different number of tokens per round: the
cache grows by the same number of slots for every row, and a row's rejected slots stay as holes that a
2-D attention mask hides; explicit position ids keep RoPE on each row's own positions. Slots that are
rejected in every row are cropped; when holes pile up the cache is compacted. With one sequence there
are never holes and the rollback is a plain `crop`.

Accounting follows SGLang: `spec_verify_ct` counts target verify forwards, `completion_tokens` counts
every generated token (the first one comes from the prefill), `spec_accept_length` =
completion_tokens / spec_verify_ct. `accept_length` leaves the prefill token out (tokens per verify
forward, bonus included): an always-wrong proposer gives exactly 1.0, a perfect one num_steps + 1.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from aerie.errors import EvaluationError
from aerie.families.protocols import Proposer

# Compact a cache when its slots exceed this many times the longest row's live slots (plus slack).
_COMPACT_FACTOR = 2
_COMPACT_SLACK = 64


class NoProposer:
    """Proposes nothing: every round is a plain one-token decode step (the greedy baseline)."""

    name = "none"
    needs_aux = False

    def add(self, seqs: Sequence[int], contexts: Sequence[list[int]], aux: Sequence[Tensor] | None) -> None:
        pass

    def propose(self, seqs: Sequence[int], k: int) -> list[list[int]]:
        return [[] for _ in seqs]

    def advance(
        self, seqs: Sequence[int], new_tokens: Sequence[list[int]], aux: Sequence[Tensor] | None
    ) -> None:
        pass

    def remove(self, seqs: Sequence[int]) -> None:
        pass


@dataclass
class SpecOutput:
    """One sequence's generation and its speculative-decoding counts."""

    output_ids: list[int]
    finish_reason: str  # "stop" (an EOS token) or "length"
    verify_ct: int  # target verify forwards this sequence took part in (SGLang's spec_verify_ct)
    reached: list[int]  # per draft position j: rounds whose draft j was verified with drafts < j accepted
    accepted: list[int]  # per draft position j: rounds whose draft j was accepted
    # Per verify round, in order: (where in output_ids its first token went, drafts it accepted). A
    # round emits the tokens from its start to the next round's (its accepted drafts and the bonus).
    rounds: list[tuple[int, int]] = field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def round_tokens(self) -> list[int]:
        """Tokens each verify round emitted (they sum to completion_tokens - 1: all but the prefill's)."""
        starts = [start for start, _ in self.rounds]
        return [end - start for start, end in zip(starts, [*starts[1:], len(self.output_ids)], strict=True)]

    @property
    def spec_accept_length(self) -> float:
        """SGLang's figure: completion_tokens / spec_verify_ct (1.0 before any verify)."""
        return self.completion_tokens / self.verify_ct if self.verify_ct else 1.0


@dataclass
class SpecStats:
    """Acceptance over many sequences (one proposer, one num_steps)."""

    num_steps: int
    sequences: int = 0
    completion_tokens: int = 0
    verify_ct: int = 0
    verify_tokens: int = 0  # tokens emitted by verify forwards (all but each sequence's prefill token)
    proposed_tokens: int = 0  # drafts sent to verification
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.reached = self.reached or [0] * self.num_steps
        self.accepted = self.accepted or [0] * self.num_steps

    def add(self, out: SpecOutput) -> None:
        self.sequences += 1
        self.completion_tokens += out.completion_tokens
        self.verify_ct += out.verify_ct
        self.verify_tokens += out.completion_tokens - 1 if out.completion_tokens else 0
        self.proposed_tokens += sum(out.reached)
        for j, (r, a) in enumerate(zip(out.reached, out.accepted, strict=False)):
            self.reached[j] += r
            self.accepted[j] += a

    @property
    def accept_length(self) -> float:
        """Tokens per target verify forward, bonus included, prefill token left out."""
        return self.verify_tokens / self.verify_ct if self.verify_ct else 1.0

    @property
    def spec_accept_length(self) -> float:
        """SGLang's figure over all sequences: Σ completion_tokens / Σ spec_verify_ct."""
        return self.completion_tokens / self.verify_ct if self.verify_ct else 1.0

    @property
    def conditional_acceptance(self) -> list[float | None]:
        """P(draft j accepted | drafts 1..j-1 accepted), per position (None where never reached)."""
        return [a / r if r else None for a, r in zip(self.accepted, self.reached, strict=True)]

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_steps": self.num_steps,
            "sequences": self.sequences,
            "completion_tokens": self.completion_tokens,
            "spec_verify_ct": self.verify_ct,
            "accept_length": round(self.accept_length, 4),
            "spec_accept_length": round(self.spec_accept_length, 4),
            "proposed_tokens": self.proposed_tokens,
            "draft_acceptance_rate": round(sum(self.accepted) / self.proposed_tokens, 4)
            if self.proposed_tokens
            else None,
            "conditional_acceptance": [
                None if c is None else round(c, 4) for c in self.conditional_acceptance
            ],
            "reached": list(self.reached),
            "accepted": list(self.accepted),
            "seconds": round(self.seconds, 3),
            "tokens_per_second": round(self.tokens_per_second, 2),
        }


def accept_chain(drafts: Sequence[int], predictions: Sequence[int], stop_ids: frozenset[int]) -> int:
    """How many drafts the target accepts: the longest prefix with drafts[j] == predictions[j]
    (predictions[j] is the target's argmax after the context and drafts[:j]). An accepted stop token
    ends the chain: what follows it is never emitted."""
    accepted = 0
    for draft, prediction in zip(drafts, predictions, strict=False):
        if draft != prediction:
            break
        accepted += 1
        if draft in stop_ids:
            break
    return accepted


def accept_sampled(
    drafts: Sequence[int],
    logits: Tensor,
    temperature: float,
    generator: torch.Generator,
    stop_ids: frozenset[int],
) -> tuple[int, int | None]:
    """Speculative sampling of one chain (see the module docstring): `logits` [len(drafts) + 1, V] are
    the target's after the context and each draft prefix. Returns (drafts accepted, the token that
    follows them: the residual draw at the first rejection or the bonus draw after the last draft; None
    when an accepted stop token ended the chain)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1).cpu()
    for j, draft in enumerate(drafts):
        p = probs[j]
        if torch.rand((), generator=generator).item() < p[draft].item():
            if draft in stop_ids:
                return j + 1, None
            continue
        residual = p.clone()
        residual[draft] = 0.0
        return j, _draw(residual, generator)
    return len(drafts), _draw(probs[len(drafts)], generator)


def _draw(weights: Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(weights, 1, generator=generator).item())


# ---------------------------------------------------------------------------------------------------
# The target's cache: an HF DynamicCache plus a [B, S] mask of live slots.


def _cache_kwarg(model: Any) -> str:
    """transformers 5.x calls the cache argument `cache`; older releases `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def crop_cache(cache: Any, remove: int) -> None:
    """Drop the last `remove` slots of an HF cache (`crop` takes a negative count in transformers >= 5,
    the length to keep before)."""
    if remove <= 0:
        return
    params = inspect.signature(cache.crop).parameters
    if "tokens_to_remove" in params:
        cache.crop(-remove)
    else:  # transformers 4.x: crop(max_length)
        cache.crop(cache.get_seq_length() - remove)


class TargetCache:
    """The target's KV cache for a batch of ragged rows."""

    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache

        self.model = model
        # A sliding window (GPT-OSS) is measured in slots: exact only while each row's live slots are
        # contiguous, so such a cache is compacted whenever a hole opens, and keeps every slot (a sliding
        # cache layer keeps only the window, which the live mask could not follow).
        self.windowed = _has_sliding_window(model.config)
        self.cache = DynamicCache() if self.windowed else DynamicCache(config=model.config)
        self.live: Tensor | None = None  # [B, S] bool: slots a query may attend to
        self._kwarg = _cache_kwarg(model)

    @property
    def slots(self) -> int:
        return 0 if self.live is None else int(self.live.shape[1])

    def forward(
        self,
        input_ids: Tensor,
        valid: Tensor,
        positions: Tensor,
        hidden_layers: Sequence[int] | None,
        last_logits_only: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """input_ids/valid/positions [B, T] -> logits [B, T, V] ([B, 1, V] with `last_logits_only`: a
        prefill needs only the next token, and B x T x V logits of long prompts are gigabytes) and, if
        asked, the hidden states of `hidden_layers` concatenated, [B, T, len * H]."""
        live = valid if self.live is None else torch.cat([self.live, valid], dim=1)
        out = self.model(
            input_ids=input_ids,
            attention_mask=live.long(),
            position_ids=positions,
            use_cache=True,
            output_hidden_states=hidden_layers is not None,
            logits_to_keep=1 if last_logits_only else 0,
            **{self._kwarg: self.cache},
        )
        self.live = live
        aux = None
        if hidden_layers is not None:
            aux = torch.cat([out.hidden_states[i] for i in hidden_layers], dim=-1)
        return out.logits, aux

    def merge(self, other: TargetCache) -> None:
        """Append another cache's rows to this batch (new sequences joining a running batch). The one
        with fewer slots is left-padded with dead slots: order within a row, and so causality, holds."""
        if other.live is None:
            return
        if self.live is None:
            self.cache, self.live = other.cache, other.live
            return
        pad_self = max(other.slots - self.slots, 0)
        pad_other = max(self.slots - other.slots, 0)
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            for name in ("keys", "values"):
                a: Any = getattr(mine, name)
                b: Any = getattr(theirs, name)
                setattr(
                    mine, name, torch.cat([_pad_slots(a, pad_self, 2), _pad_slots(b, pad_other, 2)], dim=0)
                )
        self.live = torch.cat(
            [_pad_slots(self.live, pad_self, 1), _pad_slots(other.live, pad_other, 1)], dim=0
        )

    def keep_last(self, kept: Tensor) -> None:
        """After a verify over the last T slots: `kept` [B, T] marks the slots that stay live; slots dead
        in every row are cropped (the whole rollback when there is one row)."""
        assert self.live is not None
        t = kept.shape[1]
        self.live[:, -t:] &= kept
        dead_tail = t - int(kept.any(dim=0).nonzero().max().item() + 1) if bool(kept.any()) else t
        if dead_tail:
            crop_cache(self.cache, dead_tail)
            self.live = self.live[:, : self.live.shape[1] - dead_tail]
        self.maybe_compact()

    def select(self, rows: Tensor) -> None:
        """Keep only these batch rows (finished sequences leave the batch)."""
        assert self.live is not None
        self.cache.batch_select_indices(rows)
        self.live = self.live[rows]
        self.maybe_compact()

    def maybe_compact(self) -> None:
        """Squeeze the holes out when they dominate: each row's live slots, in order, left-padded."""
        if self.live is None:
            return
        counts = self.live.sum(dim=1)
        longest = int(counts.max().item()) if counts.numel() else 0
        if self.windowed:
            # A live slot followed by a dead one: a hole the window would count.
            if not bool((self.live[:, :-1] & ~self.live[:, 1:]).any()):
                return
        elif self.live.shape[1] <= _COMPACT_FACTOR * longest + _COMPACT_SLACK:
            return
        index, live = compaction_index(self.live)
        for layer in self.cache.layers:
            keys: Any = getattr(layer, "keys", None)
            values: Any = getattr(layer, "values", None)
            if keys is None or values is None:  # a layer that was never written (KV sharing)
                continue
            layer.keys = _gather_slots(keys, index)  # type: ignore[union-attr]
            layer.values = _gather_slots(values, index)  # type: ignore[union-attr]
        self.live = live


def _has_sliding_window(config: Any) -> bool:
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return True
    return bool(getattr(config, "sliding_window", None)) and bool(getattr(config, "use_sliding_window", True))


def _gather_slots(t: Tensor, index: Tensor) -> Tensor:
    """Each row's live slots along S of a [B, heads, S, width] cache tensor. Keys and values are gathered
    each with its own width: an MLA cache holds a latent and a rope key of different widths."""
    gather = index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
    return t.gather(2, gather)


def _pad_slots(t: Tensor, n: int, dim: int) -> Tensor:
    """`n` zero (dead) slots on the left of dimension `dim`."""
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def compaction_index(live: Tensor) -> tuple[Tensor, Tensor]:
    """For a [B, S] live mask: a [B, S'] gather index of each row's live slots (left-padded with slot 0)
    and the new [B, S'] live mask, S' = the most live slots of any row."""
    counts = live.sum(dim=1)
    width = int(counts.max().item())
    b, s = live.shape
    order = torch.arange(s, device=live.device).expand(b, s)
    # Dead slots sort first (key -1), live ones keep their order; the last `width` are what we keep.
    keys = torch.where(live, order, torch.full_like(order, -1))
    sorted_slots = keys.sort(dim=1).values[:, s - width :]
    new_live = sorted_slots >= 0
    return sorted_slots.clamp(min=0), new_live


# ---------------------------------------------------------------------------------------------------
# The decoder


@dataclass
class _Row:
    seq: int
    context: list[int]  # prompt + generated
    max_new_tokens: int
    stop_ids: frozenset[int]
    reached: list[int]
    accepted: list[int]
    generated: list[int] = field(default_factory=list)
    verify_ct: int = 0
    finish_reason: str | None = None
    rounds: list[tuple[int, int]] = field(default_factory=list)

    def output(self) -> SpecOutput:
        return SpecOutput(
            output_ids=self.generated,
            finish_reason=self.finish_reason or "length",
            verify_ct=self.verify_ct,
            reached=self.reached,
            accepted=self.accepted,
            rounds=self.rounds,
        )


class SpecDecoder:
    """Speculative decoding with one proposer and a fixed chain length: greedy at `temperature` 0,
    speculative sampling above it (reproducible from `seed`).

    `generate(prompts, n)` decodes a batch to the end. A server drives the same engine step by step:
    `admit` prefills new sequences into the running batch (continuous batching), `step` runs one
    propose-verify round of every running sequence; both return the sequences that finished.
    """

    def __init__(
        self,
        model: Any,
        proposer: Proposer,
        *,
        num_steps: int,
        eos_token_ids: Sequence[int],
        aux_layers: Sequence[int] | None = None,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> None:
        if temperature < 0:
            raise EvaluationError(f"temperature must be >= 0, got {temperature}")
        if num_steps < 0:
            raise EvaluationError(f"num_steps must be >= 0, got {num_steps}")
        if proposer.needs_aux and not aux_layers:
            raise EvaluationError(
                f"proposer {proposer.name} needs the target's aux hidden states: pass aux_layers"
            )
        self.model = model
        self.proposer = proposer
        self.num_steps = num_steps
        self.stop_ids = frozenset(int(e) for e in eos_token_ids)
        self.aux_layers = list(aux_layers) if proposer.needs_aux and aux_layers else None
        self.device = next(model.parameters()).device
        self.temperature = float(temperature)
        self.generator = torch.Generator().manual_seed(seed)
        self.rows: list[_Row] = []  # running sequences, in cache row order
        self.cache = TargetCache(model)
        self._next_seq = 0

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]
    ) -> list[SpecOutput]:
        """Decode every prompt to a stop token or its `max_new_tokens`; outputs in prompt order."""
        seqs, finished = self.admit(prompts, max_new_tokens)
        done = dict(finished)
        while self.rows:
            done.update(self.step())
        return [done[s] for s in seqs]

    @torch.no_grad()
    def admit(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        stop_token_ids: Sequence[frozenset[int]] | None = None,
    ) -> tuple[list[int], list[tuple[int, SpecOutput]]]:
        """Prefill `prompts` and add them to the running batch. Returns their sequence ids and the
        (id, output) of those already finished (one token asked for, or a stop token first).
        `stop_token_ids` replaces the EOS ids per prompt (an empty set never stops early)."""
        if not prompts:
            return [], []
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(budgets) != len(prompts) or any(b < 1 for b in budgets):
            raise EvaluationError(
                f"max_new_tokens must be >= 1 for each of {len(prompts)} prompts, got {budgets}"
            )
        if any(len(p) == 0 for p in prompts):
            raise EvaluationError("an empty prompt cannot be decoded (no position to predict from)")
        stops = list(stop_token_ids) if stop_token_ids is not None else [self.stop_ids] * len(prompts)
        k = self.num_steps
        rows = []
        for prompt, budget, stop in zip(prompts, budgets, stops, strict=True):
            rows.append(_Row(self._next_seq, [int(t) for t in prompt], budget, stop, [0] * k, [0] * k))
            self._next_seq += 1
        cache = TargetCache(self.model)
        self._prefill(cache, rows)
        self.cache.merge(cache)
        self.rows += rows
        return [r.seq for r in rows], self._retire()

    @torch.no_grad()
    def step(self) -> list[tuple[int, SpecOutput]]:
        """One propose-verify round of every running sequence; returns the (id, output) that finished."""
        if self.rows:
            self._round(self.cache, self.rows)
        return self._retire()

    def abort_all(self) -> list[int]:
        """Drop every running sequence (after a failed step); returns their ids."""
        gone = [r.seq for r in self.rows]
        if gone:
            self.proposer.remove(gone)
        self.rows = []
        self.cache = TargetCache(self.model)
        return gone

    def _prefill(self, cache: TargetCache, rows: list[_Row]) -> None:
        """Left-padded prompts in one forward; each row's first token is the target's argmax."""
        longest = max(len(r.context) for r in rows)
        b = len(rows)
        ids = torch.zeros(b, longest, dtype=torch.long)
        valid = torch.zeros(b, longest, dtype=torch.bool)
        positions = torch.zeros(b, longest, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r.context)
            ids[i, longest - n :] = torch.tensor(r.context)
            valid[i, longest - n :] = True
            positions[i, longest - n :] = torch.arange(n)
        logits, aux = cache.forward(
            ids.to(self.device),
            valid.to(self.device),
            positions.to(self.device),
            self.aux_layers,
            last_logits_only=True,
        )
        first = [self._first_token(row_logits) for row_logits in logits[:, -1]]
        aux_rows: list[Tensor] | None = None
        if aux is not None:
            aux_rows = [aux[i, longest - len(r.context) :] for i, r in enumerate(rows)]
        for r, token in zip(rows, first, strict=True):
            self._emit(r, [int(token)])
        # Row i of the aux states (position i) is paired with the token after it: context[1:] + first.
        self.proposer.add([r.seq for r in rows], [list(r.context) for r in rows], aux_rows)

    def _round(self, cache: TargetCache, rows: list[_Row]) -> None:
        """Propose, verify in one target forward, accept, roll back."""
        proposals = self.proposer.propose([r.seq for r in rows], self.num_steps)
        drafts = []
        for r, proposal in zip(rows, proposals, strict=True):
            # Drafts past what the sequence may still emit are never verified: R tokens left = at most
            # R-1 drafts plus the bonus.
            budget = r.max_new_tokens - len(r.generated) - 1
            drafts.append([int(t) for t in proposal[: min(self.num_steps, budget)]])
        width = 1 + max(len(d) for d in drafts)
        b = len(rows)
        ids = torch.zeros(b, width, dtype=torch.long)
        valid = torch.zeros(b, width, dtype=torch.bool)
        positions = torch.zeros(b, width, dtype=torch.long)
        for i, (r, d) in enumerate(zip(rows, drafts, strict=True)):
            n = 1 + len(d)
            ids[i, :n] = torch.tensor([r.context[-1], *d])
            valid[i, :n] = True
            # Padding slots get a position too (they are masked): keep it in range.
            positions[i] = len(r.context) - 1 + torch.arange(width).clamp(max=n - 1)
        logits, aux = cache.forward(
            ids.to(self.device), valid.to(self.device), positions.to(self.device), self.aux_layers
        )
        kept = torch.zeros(b, width, dtype=torch.bool)
        new_tokens: list[list[int]] = []
        for i, (r, d) in enumerate(zip(rows, drafts, strict=True)):
            a, follow = self._verify(d, logits[i, : len(d) + 1], r.stop_ids)
            for j in range(min(len(d), a + 1)):
                r.reached[j] += 1
            for j in range(a):
                r.accepted[j] += 1
            new = d[:a]
            if follow is not None:
                new.append(follow)
            r.verify_ct += 1
            r.rounds.append((len(r.generated), a))
            kept[i, : a + 1] = True  # x_{L-1} and the accepted drafts are now in the cache for good
            new_tokens.append(new)
            self._emit(r, new)
        cache.keep_last(kept.to(self.device))
        # Aux rows 0..a are the positions of x_{L-1}, d_1..d_a: row i pairs with new token i.
        aux_rows = None if aux is None else [aux[i, : len(n)] for i, n in enumerate(new_tokens)]
        self.proposer.advance([r.seq for r in rows], new_tokens, aux_rows)

    def _first_token(self, logits: Tensor) -> int:
        if self.temperature == 0:
            return int(logits.argmax().item())
        return _draw(torch.softmax(logits.float() / self.temperature, dim=-1).cpu(), self.generator)

    def _verify(self, drafts: list[int], logits: Tensor, stop_ids: frozenset[int]) -> tuple[int, int | None]:
        """(drafts accepted, the token after them or None when an accepted stop token ends the chain)."""
        if self.temperature > 0:
            return accept_sampled(drafts, logits, self.temperature, self.generator, stop_ids)
        predictions = logits.argmax(dim=-1).tolist()
        a = accept_chain(drafts, predictions, stop_ids)
        return a, None if a and drafts[a - 1] in stop_ids else int(predictions[a])

    @staticmethod
    def _emit(row: _Row, tokens: list[int]) -> None:
        for token in tokens:
            row.generated.append(token)
            row.context.append(token)
            # Length first, as SGLang's check_finished: a stop token as the last allowed one is "length".
            if len(row.generated) >= row.max_new_tokens:
                row.finish_reason = "length"
                return
            if token in row.stop_ids:
                row.finish_reason = "stop"
                return

    def _retire(self) -> list[tuple[int, SpecOutput]]:
        """Take finished sequences out of the batch, the cache and the proposer."""
        done = [r for r in self.rows if r.finish_reason is not None]
        if not done:
            return []
        self.proposer.remove([r.seq for r in done])
        keep = [i for i, r in enumerate(self.rows) if r.finish_reason is None]
        if keep:
            self.cache.select(torch.tensor(keep, dtype=torch.long, device=self.device))
        else:
            self.cache = TargetCache(self.model)
        self.rows = [self.rows[i] for i in keep]
        return [(r.seq, r.output()) for r in done]


def greedy_reference(
    model: Any, prompt: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int]
) -> list[int]:
    """The target's plain greedy continuation through `transformers`' own `generate` (an independent
    implementation, used to check that speculative decoding is lossless)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], device=device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=list(eos_token_ids),
        pad_token_id=int(list(eos_token_ids)[0]),
    )
    return [int(t) for t in out[0, ids.shape[1] :].tolist()]
