"""Speculative decoding against the real embedded target: lossless greedy output whatever the proposer,
SGLang-style acceptance accounting, prompt lookup, and the batched EAGLE-3 drafter forward against the
drafter's own single-sequence `step`."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from aerie.draft.export import draft_config_for
from aerie.draft.model import DraftKVCache, Eagle3Drafter
from aerie.draft.target_weights import load_embedding
from aerie.engine.speculative import decoder as spec_decode
from aerie.engine.speculative import eagle
from aerie.engine.speculative.decoder import (
    NoProposer,
    SpecDecoder,
    SpecStats,
    accept_chain,
    compaction_index,
    greedy_reference,
)
from aerie.engine.speculative.eagle import EagleProposer
from aerie.engine.speculative.prompt_lookup import PromptLookupProposer

MAX_NEW = 13  # = 1 + 3 * (3 + 1): a perfect 3-step proposer fills every round exactly
TEXTS = (
    "The capital of France is",
    "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9,",
    "Repeat after me: the cat sat on the mat. the cat sat on the mat.",
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The CI box is shared: one intra-op thread avoids spin-wait contention (4x faster here).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def target(smollm2):
    return smollm2.load_model("cpu", "float32")


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    tok = smollm2.load_tokenizer()
    return [list(tok(text).input_ids) for text in TEXTS]


@pytest.fixture(scope="module")
def reference(target, prompts, smollm2) -> list[list[int]]:
    """The target's plain greedy output through transformers' own generate()."""
    return [greedy_reference(target, p, MAX_NEW, smollm2.eos_token_ids) for p in prompts]


@pytest.fixture(scope="module")
def random_drafter(smollm2) -> Eagle3Drafter:
    """An untrained drafter with weights large enough that its drafts vary from step to step."""
    torch.manual_seed(0)
    drafter = Eagle3Drafter(draft_config_for(smollm2, 512), load_embedding(smollm2)).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.05)
        drafter.d2t.copy_(torch.randint(0, 20000, (512,)))
    return drafter


class RandomProposer:
    """Proposes random tokens: every draft is (almost surely) wrong."""

    name = "random"
    needs_aux = False

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def add(self, seqs: Sequence[int], contexts: Sequence[list[int]], aux: Sequence[Tensor] | None) -> None:
        pass

    def propose(self, seqs: Sequence[int], k: int) -> list[list[int]]:
        return [[self.rng.randrange(1000, 40000) for _ in range(k)] for _ in seqs]

    def advance(
        self, seqs: Sequence[int], new_tokens: Sequence[list[int]], aux: Sequence[Tensor] | None
    ) -> None:
        pass

    def remove(self, seqs: Sequence[int]) -> None:
        pass


class OracleProposer(RandomProposer):
    """Proposes the target's true greedy continuation (known from the reference run)."""

    name = "oracle"

    def __init__(self, prompts: list[list[int]], reference: list[list[int]]) -> None:
        super().__init__()
        self.full = {i: p + r for i, (p, r) in enumerate(zip(prompts, reference, strict=True))}
        self.length: dict[int, int] = {}

    def add(self, seqs: Sequence[int], contexts: Sequence[list[int]], aux: Sequence[Tensor] | None) -> None:
        for seq, context in zip(seqs, contexts, strict=True):
            self.length[seq] = len(context)

    def propose(self, seqs: Sequence[int], k: int) -> list[list[int]]:
        return [self.full[s][self.length[s] : self.length[s] + k] for s in seqs]

    def advance(
        self, seqs: Sequence[int], new_tokens: Sequence[list[int]], aux: Sequence[Tensor] | None
    ) -> None:
        for seq, tokens in zip(seqs, new_tokens, strict=True):
            self.length[seq] += len(tokens)


def _decode(target, proposer, prompts, smollm2, *, steps: int, batch: int) -> list[spec_decode.SpecOutput]:
    decoder = SpecDecoder(
        target,
        proposer,
        num_steps=steps,
        eos_token_ids=smollm2.eos_token_ids,
        aux_layers=smollm2.aux_layers_input,
    )
    outs: list[spec_decode.SpecOutput] = []
    for i in range(0, len(prompts), batch):
        outs += decoder.generate(prompts[i : i + batch], MAX_NEW)
    return outs


# -- the key property: lossless whatever the proposer -------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3])
def test_prompt_lookup_output_is_the_targets_greedy_output(target, prompts, reference, smollm2, batch):
    outs = _decode(target, PromptLookupProposer(), prompts, smollm2, steps=3, batch=batch)
    assert [o.output_ids for o in outs] == reference
    # The repeated sentence makes prompt lookup right at least once: more than one token per forward.
    assert sum(o.accepted[0] for o in outs) > 0


def test_untrained_eagle3_drafter_is_lossless_batched_with_compaction(
    target, prompts, reference, smollm2, random_drafter, monkeypatch
):
    # Compact the caches at every opportunity so the hole-squeezing path runs on this short decode.
    for module in (spec_decode, eagle):
        monkeypatch.setattr(module, "_COMPACT_FACTOR", 0)
        monkeypatch.setattr(module, "_COMPACT_SLACK", 0)
    outs = _decode(target, EagleProposer(random_drafter), prompts, smollm2, steps=3, batch=3)
    assert [o.output_ids for o in outs] == reference
    assert all(o.verify_ct > 0 for o in outs)


def test_random_drafts_single_sequence_lossless(target, prompts, reference, smollm2):
    outs = _decode(target, RandomProposer(), prompts[:1], smollm2, steps=5, batch=1)
    assert outs[0].output_ids == reference[0]


# -- acceptance accounting ----------------------------------------------------------------------------


def test_oracle_proposer_accepts_every_draft(target, prompts, reference, smollm2):
    steps = 3
    outs = _decode(target, OracleProposer(prompts, reference), prompts, smollm2, steps=steps, batch=3)
    assert [o.output_ids for o in outs] == reference
    stats = SpecStats(steps)
    for out in outs:
        stats.add(out)
    full = [o for o in outs if o.finish_reason == "length"]
    assert full, "the test needs at least one sequence that runs to max_new_tokens"
    for out in full:
        # 1 prefill token + 3 rounds of (3 drafts + 1 bonus).
        assert out.verify_ct == 3
        assert out.spec_accept_length == MAX_NEW / 3
    assert stats.conditional_acceptance == [1.0, 1.0, 1.0]
    if len(full) == len(outs):
        assert stats.accept_length == steps + 1


def test_always_wrong_proposer_gives_one_token_per_forward(target, prompts, reference, smollm2):
    outs = _decode(target, RandomProposer(), prompts, smollm2, steps=3, batch=3)
    assert [o.output_ids for o in outs] == reference
    stats = SpecStats(3)
    for out in outs:
        stats.add(out)
        assert out.verify_ct == len(out.output_ids) - 1
    assert stats.accept_length == 1.0
    assert stats.conditional_acceptance == [0.0, None, None]
    assert stats.to_dict()["draft_acceptance_rate"] == 0.0


def test_no_proposer_is_plain_greedy(target, prompts, reference, smollm2):
    outs = _decode(target, NoProposer(), prompts, smollm2, steps=0, batch=3)
    assert [o.output_ids for o in outs] == reference


def test_accept_chain_stops_at_mismatch_and_stop_token():
    assert accept_chain([5, 6, 7], [5, 6, 9, 1], frozenset()) == 2
    assert accept_chain([5, 6, 7], [4, 6, 7, 1], frozenset()) == 0
    assert accept_chain([5, 2, 7], [5, 2, 7, 1], frozenset({2})) == 2  # nothing after an accepted EOS
    assert accept_chain([], [3], frozenset()) == 0


def test_bad_input_is_refused(target, smollm2):
    decoder = SpecDecoder(target, NoProposer(), num_steps=3, eos_token_ids=smollm2.eos_token_ids)
    with pytest.raises(spec_decode.EvaluationError, match="empty prompt"):
        decoder.generate([[1, 2], []], 4)
    with pytest.raises(spec_decode.EvaluationError, match="max_new_tokens"):
        decoder.generate([[1, 2]], 0)
    with pytest.raises(spec_decode.EvaluationError, match="aux"):
        SpecDecoder(target, EagleProposer.__new__(EagleProposer), num_steps=3, eos_token_ids=[0])


# -- prompt lookup, compaction, batched drafter ------------------------------------------------------


def test_prompt_lookup_prefers_the_longest_latest_match():
    p = PromptLookupProposer(max_ngram=3, min_ngram=1)
    p.add([0], [[1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 2, 3]], None)
    # tail (1?) 2 3: the 3-gram [7,2,3] never occurred; the 2-gram [2,3] last occurred at index 6 -> 5, 7, ...
    assert p.propose([0], 2) == [[5, 7]]
    p.advance([0], [[8]], None)  # tail 3 8: unseen as a bigram, unigram 8 unseen -> nothing
    assert p.propose([0], 3) == [[]]
    p.advance([0], [[1, 2]], None)  # tail 8 1 2 -> [1, 2] seen twice; latest follower is 3 (index 6)
    assert p.propose([0], 4) == [[3, 5, 7, 2]]


def test_compaction_index_keeps_each_rows_live_slots_in_order():
    live = torch.tensor([[1, 0, 1, 0, 1], [0, 0, 0, 1, 0]], dtype=torch.bool)
    index, new_live = compaction_index(live)
    assert index.tolist() == [[0, 2, 4], [0, 0, 3]]
    assert new_live.tolist() == [[True, True, True], [False, False, True]]


def test_batched_drafter_matches_its_single_sequence_step(random_drafter, smollm2):
    """Ragged rows in one forward give the logits `Eagle3Drafter.step` gives each sequence alone."""
    d, h = random_drafter, smollm2.geometry.hidden_size
    torch.manual_seed(1)
    contexts = [torch.randint(0, 49152, (n,)).tolist() for n in (9, 4)]
    aux0 = [torch.randn(len(c) - 1, 3 * h) for c in contexts]
    new = [[5, 6, 7], [8]]
    aux1 = [torch.randn(len(n), 3 * h) for n in new]

    logged: list[Tensor] = []

    class Logged(EagleProposer):
        def _to_target(self, logits: Tensor) -> Tensor:
            logged.append(logits.clone())
            return super()._to_target(logits)

    batched = Logged(d)
    batched.add([0, 1], contexts, aux0)
    first = batched.propose([0, 1], 3)
    batched.advance([0, 1], new, aux1)
    second = batched.propose([0, 1], 3)
    batched_logits = torch.stack(logged)  # [2 rounds * 3 steps, B, Vd]

    for row, context in enumerate(contexts):
        cache = DraftKVCache(d.config, "cpu", torch.float32)
        single_logits, chains, position = [], [], 0
        for tokens, aux in ((context[1:], aux0[row]), (new[row], aux1[row])):
            cache.crop(position)  # drop the previous round's draft steps
            logits, out = d.step(
                torch.tensor(tokens), aux, torch.arange(position, position + len(tokens)), cache
            )
            position += len(tokens)
            chain = [int(d.to_target_ids(logits[-1].argmax()))]
            single_logits.append(logits[-1])
            g = out[-1:]
            for j in range(1, 3):
                logits, g = d.step(torch.tensor([chain[-1]]), g, torch.tensor([position + j - 1]), cache)
                chain.append(int(d.to_target_ids(logits[-1].argmax())))
                single_logits.append(logits[-1])
            chains.append(chain)
        assert [first[row], second[row]] == chains
        torch.testing.assert_close(batched_logits[:, row], torch.stack(single_logits), atol=1e-4, rtol=1e-4)


def test_sequences_joining_a_running_batch_stay_lossless(target, prompts, reference, smollm2, random_drafter):
    """Continuous batching (a server's use): a sequence admitted mid-flight, another with its own budget."""
    decoder = SpecDecoder(
        target,
        EagleProposer(random_drafter),
        num_steps=3,
        eos_token_ids=smollm2.eos_token_ids,
        aux_layers=smollm2.aux_layers_input,
    )
    first, done = decoder.admit(prompts[:1], MAX_NEW)
    finished = dict(done)
    finished.update(decoder.step())
    finished.update(decoder.step())
    later, done = decoder.admit(prompts[1:], [MAX_NEW, 5])
    finished.update(done)
    while decoder.num_running:
        finished.update(decoder.step())
    assert finished[first[0]].output_ids == reference[0]
    assert finished[later[0]].output_ids == reference[1]
    assert finished[later[1]].output_ids == reference[2][:5]
    assert finished[later[1]].finish_reason == "length"
