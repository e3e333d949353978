"""Speculative sampling is lossless: at a temperature > 0 the decoder's outputs are distributed as the
target's own samples, whatever the proposer drafts.

A tiny random Llama (4-token vocabulary, peaked logits) is the target, so the exact distribution of its
first four sampled tokens can be enumerated (4 + 16 + 64 forwards). The decoder draws 30,000 sequences
with a proposer that drafts 2 tokens per round from an unrelated bigram table (sometimes right, often
wrong: both branches of the rule run), and a chi-square goodness-of-fit test against the exact
distribution must not reject at significance 1e-4. The same test rejects a plainly sampled control
that is wrong (the draft accepted without the rejection rule), so it can fail.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from aerie.engine.speculative import decoder as spec_decode
from aerie.engine.speculative.decoder import SpecDecoder, SpecStats, accept_sampled

VOCAB = 4
NEW_TOKENS = 4
PROMPT = [1, 3, 0]
SAMPLES = 30_000
NEVER = 99  # a stop id outside the vocabulary: every sequence runs to NEW_TOKENS


@pytest.fixture(scope="module")
def tiny_target() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # peaked, context-dependent distributions (the default init is near uniform)
        model.lm_head.weight.normal_(0.0, 0.6)
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    return model


class BigramProposer:
    """Drafts by following a fixed random bigram table from the last token (unrelated to the target)."""

    name = "bigram"
    needs_aux = False

    def __init__(self) -> None:
        self.table = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7)).tolist()
        self.last: dict[int, int] = {}

    def add(self, seqs: Sequence[int], contexts: Sequence[list[int]], aux: Sequence[Tensor] | None) -> None:
        for s, c in zip(seqs, contexts, strict=True):
            self.last[s] = c[-1]

    def propose(self, seqs: Sequence[int], k: int) -> list[list[int]]:
        chains = []
        for s in seqs:
            chain, token = [], self.last[s]
            for _ in range(k):
                token = self.table[token]
                chain.append(token)
            chains.append(chain)
        return chains

    def advance(
        self, seqs: Sequence[int], new_tokens: Sequence[list[int]], aux: Sequence[Tensor] | None
    ) -> None:
        for s, new in zip(seqs, new_tokens, strict=True):
            self.last[s] = new[-1]

    def remove(self, seqs: Sequence[int]) -> None:
        for s in seqs:
            self.last.pop(s, None)


def exact_distribution(model: torch.nn.Module, temperature: float) -> dict[tuple[int, ...], float]:
    """P(t1..tn | PROMPT) of the target sampled at `temperature`, by enumeration."""
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            prefixes = list(dist)
            ids = torch.tensor([PROMPT + list(p) for p in prefixes])
            probs = torch.softmax(model(ids).logits[:, -1].double() / temperature, dim=-1)
            dist = {
                (*p, t): dist[p] * float(probs[i, t]) for i, p in enumerate(prefixes) for t in range(VOCAB)
            }
    return dist


def speculative_samples(model: torch.nn.Module, temperature: float) -> tuple[Counter, SpecStats]:
    decoder = SpecDecoder(
        model, BigramProposer(), num_steps=2, eos_token_ids=[NEVER], temperature=temperature, seed=1
    )
    outputs = decoder.generate([PROMPT] * SAMPLES, NEW_TOKENS)
    stats = SpecStats(2)
    for out in outputs:
        stats.add(out)
    return Counter(tuple(o.output_ids) for o in outputs), stats


def chi_square_rejects(counts: Counter, exact: dict[tuple[int, ...], float], alpha_z: float = 3.719) -> bool:
    """Pearson's test; cells expected under 5 are pooled. True when the fit is rejected at the
    significance whose normal quantile is `alpha_z` (3.719: 1e-4, one-sided), through the
    Wilson-Hilferty approximation of the chi-square quantile."""
    n = sum(counts.values())
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, p in exact.items():
        expected = n * p
        if expected < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += expected
            continue
        stat += (counts.get(cell, 0) - expected) ** 2 / expected
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        df += 1
    critical = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_speculative_sampling_matches_the_targets_distribution(tiny_target, temperature):
    exact = exact_distribution(tiny_target, temperature)
    counts, stats = speculative_samples(tiny_target, temperature)
    assert sum(counts.values()) == SAMPLES
    assert all(len(seq) == NEW_TOKENS for seq in counts)
    # Both branches of the rule ran: some drafts were accepted, some rejected.
    assert 0 < stats.accepted[0] < stats.reached[0]
    assert not chi_square_rejects(counts, exact)


def test_the_fit_test_rejects_a_sampler_that_skips_the_rejection_rule(tiny_target, monkeypatch):
    def accept_every_draft(drafts, logits, temperature, generator, stop_ids):
        # Wrong on purpose: drafts kept whatever the target thinks of them, then a bonus draw.
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return len(drafts), int(torch.multinomial(probs[len(drafts)], 1, generator=generator))

    monkeypatch.setattr(spec_decode, "accept_sampled", accept_every_draft)
    counts, _ = speculative_samples(tiny_target, 1.0)
    assert chi_square_rejects(counts, exact_distribution(tiny_target, 1.0))


def test_greedy_is_unchanged_at_temperature_zero(tiny_target):
    decoder = SpecDecoder(tiny_target, BigramProposer(), num_steps=2, eos_token_ids=[NEVER])
    out = decoder.generate([PROMPT], NEW_TOKENS)[0]
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        greedy = tiny_target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
        )
    assert out.output_ids == greedy[0, len(PROMPT) :].tolist()


def test_accept_sampled_follows_the_rule_at_the_extremes():
    gen = torch.Generator().manual_seed(0)
    certain = torch.full((3, VOCAB), -1e9)
    certain[:, 2] = 0.0  # the target is sure of token 2 at every position
    assert accept_sampled([2, 2], certain, 1.0, gen, frozenset()) == (2, 2)  # both accepted, bonus 2
    assert accept_sampled([1, 2], certain, 1.0, gen, frozenset()) == (0, 2)  # rejected, residual is 2
    assert accept_sampled([2, 2], certain, 1.0, gen, frozenset({2})) == (1, None)  # an accepted stop ends it


def test_a_negative_temperature_is_refused(tiny_target):
    from aerie.errors import EvaluationError

    with pytest.raises(EvaluationError, match="temperature"):
        SpecDecoder(tiny_target, BigramProposer(), num_steps=2, eos_token_ids=[NEVER], temperature=-0.1)
