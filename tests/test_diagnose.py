"""The teacher-forced diagnosis: its round walk on hand-made hits, and, on the real embedded target with a
drafter trained here to draft some tokens right, that the acceptance it simulates from the training-time
test forward equals the acceptance the speculative decoder measures (train/serve consistency)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aerie.draft.export import draft_config_for
from aerie.draft.model import Eagle3Drafter
from aerie.draft.target_weights import load_embedding
from aerie.evaluate.diagnose import diagnose, simulate_rounds
from aerie.evaluate.eagle import EagleProposer, hidden_state_indices
from aerie.evaluate.spec_decode import SpecDecoder, SpecStats, greedy_reference

TEXTS = ("The capital of France is", "Write a haiku about the sea.", "List three colors:")
NEW = 24
STEPS = 3
EPOCHS = 8  # enough to draft some tokens right, not all


def test_rounds_accept_the_correct_prefix_then_skip_past_the_bonus_token() -> None:
    # prompt of 2 tokens (x0 x1), answer x2..x9 (T = 10); hits[k, t]: step k of row t names x_{t+2+k}.
    hits = torch.zeros(3, 9, dtype=torch.bool)
    hits[:, 1] = torch.tensor([True, True, False])  # round 1 (row 1): 2 accepted, bonus -> committed x5
    hits[:, 4] = torch.tensor([True, True, True])  # round 2 (row 4): all 3 -> committed x9, the end
    assert simulate_rounds(hits, prompt_len=2, total_len=10, max_new_tokens=100) == [2, 3]
    # An answer stopped by length at x8 (7 new tokens): in round 2 only 2 drafts fit before the bonus.
    assert simulate_rounds(hits[:, :8], prompt_len=2, total_len=9, max_new_tokens=7) == [2, 2]
    assert simulate_rounds(torch.zeros(3, 9, dtype=torch.bool), 2, 10, 8) == [0] * 7


@pytest.fixture(scope="module")
def target(smollm2):
    torch.set_num_threads(1)
    return smollm2.load_model("cpu", "float32")


@pytest.fixture(scope="module")
def pairs(smollm2, target) -> list[tuple[list[int], list[int]]]:
    tok = smollm2.load_tokenizer()
    prompts = [list(tok(text).input_ids) for text in TEXTS]
    return [(p, greedy_reference(target, p, NEW, smollm2.eos_token_ids)) for p in prompts]


def _trained_drafter(smollm2, target, pairs) -> Eagle3Drafter:
    """A drafter fitted (hard labels, TTT forward) to these answers for a few dozen steps: right on some
    tokens, wrong on others, which is what makes the comparison below informative."""
    used = torch.unique(torch.tensor([t for p, a in pairs for t in p + a]))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(draft_config_for(smollm2, len(used)), load_embedding(smollm2))
    t2d = torch.zeros(smollm2.vocab_size, dtype=torch.bool)
    t2d[used] = True
    drafter.set_vocab(used - torch.arange(len(used)), t2d)
    to_draft = torch.full((smollm2.vocab_size,), -100)
    to_draft[used] = torch.arange(len(used))
    layers = hidden_state_indices(drafter.config)
    batches = []
    with torch.no_grad():
        for p, a in pairs:
            ids = torch.tensor(p + a)
            states = target(ids[None], output_hidden_states=True).hidden_states
            batches.append((torch.cat([states[i][0] for i in layers], -1), ids))
    optim = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(EPOCHS):
        for aux, ids in batches:
            t = ids.shape[0]
            logits = drafter(aux, ids, torch.arange(t), torch.zeros_like(ids), STEPS)
            loss = torch.stack(
                [F.cross_entropy(lg[: t - 2 - k], to_draft[ids[2 + k :]]) for k, lg in enumerate(logits)]
            ).sum()
            optim.zero_grad()
            loss.backward()
            optim.step()
    return drafter.eval()


def test_simulated_acceptance_equals_the_decoders(smollm2, target, pairs) -> None:
    drafter = _trained_drafter(smollm2, target, pairs)
    proposer = EagleProposer(drafter)
    decoder = SpecDecoder(
        target, proposer, num_steps=STEPS, eos_token_ids=smollm2.eos_token_ids, aux_layers=proposer.aux_layers
    )
    outputs = decoder.generate([p for p, _ in pairs], NEW)
    assert [o.output_ids for o in outputs] == [a for _, a in pairs]  # lossless, so the same answers
    stats = SpecStats(STEPS)
    for out in outputs:
        stats.add(out)
    found = diagnose(target, drafter, pairs, STEPS, NEW)
    assert 1.3 < stats.accept_length < STEPS + 1  # some drafts right, some wrong: the check means something
    assert found["rounds"] == stats.verify_ct
    assert found["simulated_accept_length"] == pytest.approx(stats.accept_length, abs=1e-3)
    assert set(found["step0_accuracy_by_answer_position"]) == {"0-63"}
    assert all(0.0 <= x <= 1.0 for x in found["per_token_accuracy"])
