"""The teacher-forced diagnosis: its round walk on hand-made hits, and, on the real embedded target with a
drafter trained here to draft some tokens right, that the acceptance it simulates from the training-time
test forward equals the acceptance the speculative decoder measures (train/serve consistency), and that
the trainer's held-out `accept_length_rounds`, over the same answers packed into one row, equals it too."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from aerie.draft.export import draft_config_for
from aerie.draft.model import Eagle3Drafter
from aerie.draft.target_weights import load_embedding
from aerie.engine.speculative.decoder import SpecDecoder, SpecStats, greedy_reference
from aerie.engine.speculative.eagle import EagleProposer, hidden_state_indices
from aerie.evaluate.diagnose import diagnose
from aerie.shards.format import HiddenSample
from aerie.train.config import TrainConfig
from aerie.train.data import Batch
from aerie.train.distributed import DistInfo
from aerie.train.loop import TrainSpec, build_trainer, evaluate_batches
from aerie.train.teaching import simulate_rounds
from tests.train_support import write_shards

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


@pytest.fixture(scope="module")
def drafter(smollm2, target, pairs) -> Eagle3Drafter:
    """A drafter fitted (hard labels, TTT forward) to these answers for a few dozen steps: right on some
    tokens, wrong on others, which is what makes the comparison below informative."""
    used = torch.unique(torch.tensor([t for p, a in pairs for t in p + a]))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(draft_config_for(smollm2, len(used)), load_embedding(smollm2))
    t2d = torch.zeros(smollm2.geometry.vocab_size, dtype=torch.bool)
    t2d[used] = True
    drafter.set_vocab(used - torch.arange(len(used)), t2d)
    to_draft = torch.full((smollm2.geometry.vocab_size,), -100)
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


@pytest.fixture(scope="module")
def measured(smollm2, target, pairs, drafter) -> SpecStats:
    """What the speculative decoder (the drafter proposing, the target verifying) measures on the prompts."""
    proposer = EagleProposer(drafter)
    decoder = SpecDecoder(
        target, proposer, num_steps=STEPS, eos_token_ids=smollm2.eos_token_ids, aux_layers=proposer.aux_layers
    )
    outputs = decoder.generate([p for p, _ in pairs], NEW)
    assert [o.output_ids for o in outputs] == [a for _, a in pairs]  # lossless, so the same answers
    stats = SpecStats(STEPS)
    for out in outputs:
        stats.add(out)
    return stats


def test_simulated_acceptance_equals_the_decoders(target, pairs, drafter, measured) -> None:
    stats = measured
    found = diagnose(target, drafter, pairs, STEPS, NEW)
    assert 1.3 < stats.accept_length < STEPS + 1  # some drafts right, some wrong: the check means something
    assert found["rounds"] == stats.verify_ct
    assert found["simulated_accept_length"] == pytest.approx(stats.accept_length, abs=1e-3)
    assert set(found["step0_accuracy_by_answer_position"]) == {"0-63"}
    assert all(0.0 <= x <= 1.0 for x in found["per_token_accuracy"])
    # The drafter's vocab holds every token here: forgiving misses outside it changes nothing.
    assert found["vocab_bound_accept_length"] == found["simulated_accept_length"]


def test_the_vocab_bound_forgives_exactly_the_tokens_outside_the_vocab(target, pairs, drafter) -> None:
    # The same drafts, but every answer token marked outside the vocab (t2d only; d2t maps drafts as
    # before): the bound becomes the perfect drafter's rounds, the simulated figure stays.
    found = diagnose(target, drafter, pairs, STEPS, NEW)
    narrowed = copy.deepcopy(drafter)
    narrowed.t2d[torch.tensor([t for _, a in pairs for t in a])] = False
    bound = diagnose(target, narrowed, pairs, STEPS, NEW)
    assert bound["simulated_accept_length"] == found["simulated_accept_length"]
    totals = [len(p) + len(a) for p, a in pairs]
    perfect = sum(
        len(simulate_rounds(torch.ones(STEPS, t - 1, dtype=torch.bool), len(p), t, NEW))
        for (p, _), t in zip(pairs, totals, strict=True)
    )
    verify_tokens = sum(len(a) - 1 for _, a in pairs)
    assert bound["vocab_bound_accept_length"] == round(verify_tokens / perfect, 4)
    assert bound["vocab_bound_accept_length"] > found["simulated_accept_length"]


@torch.no_grad()
def _packed_row(target, drafter: Eagle3Drafter, pairs) -> tuple[Batch, list[HiddenSample]]:
    """The (prompt, answer) pairs as the extract stage captures them (aux states, final hidden state,
    answer tokens supervised), back to back in one packed row of fp32 (shards round to bf16)."""
    samples = []
    for i, (p, a) in enumerate(pairs):
        ids = torch.tensor(p + a)
        states = target(ids[None], output_hidden_states=True).hidden_states
        aux = torch.cat([states[j][0] for j in hidden_state_indices(drafter.config)], -1)
        mask = torch.zeros(ids.shape[0], dtype=torch.bool)
        mask[len(p) :] = True
        samples.append(HiddenSample(f"pair-{i}", ids, mask, aux, states[-1][0]))
    batch = Batch(
        input_ids=torch.cat([s.input_ids for s in samples]),
        loss_mask=torch.cat([s.loss_mask for s in samples]),
        positions=torch.cat([torch.arange(s.input_ids.shape[0]) for s in samples]),
        doc_ids=torch.cat(
            [torch.full(s.input_ids.shape, i, dtype=torch.int32) for i, s in enumerate(samples)]
        ),
        aux_hidden=torch.cat([s.aux_hidden for s in samples]),
        last_hidden=torch.cat([s.last_hidden for s in samples]),
        tokens=sum(s.input_ids.shape[0] for s in samples),
    )
    return batch, samples


def test_trainers_round_walk_equals_the_decoders_acceptance(
    smollm2, target, pairs, drafter, measured, tmp_path: Path
) -> None:
    """The trainer (built as the train stage builds it, the fitted drafter's weights loaded), evaluating the
    decoder's own answers: `accept_length_rounds` is what the decoder measured; `accept_length`, the
    per-position estimate, is not (it averages over positions the rounds never start at)."""
    batch, samples = _packed_row(target, drafter, pairs)
    vocab = {"used": drafter.d2t + torch.arange(drafter.d2t.numel()), "d2t": drafter.d2t, "t2d": drafter.t2d}
    save_file({k: v.contiguous() for k, v in vocab.items()}, str(tmp_path / "vocab.safetensors"))
    shards = [str(p) for p in write_shards(samples, tmp_path / "shards")]
    cfg = TrainConfig(
        drafter={"family": "eagle3", "draft_vocab_size": drafter.config.draft_vocab_size, "ttt_length": STEPS},
        device="cpu",
        batch_tokens=batch.tokens, max_length=batch.tokens,
    )  # fmt: skip
    spec = TrainSpec(
        cfg=cfg, target=smollm2, train_shards=shards, eval_shards=shards,
        vocab_path=str(tmp_path / "vocab.safetensors"), work_dir=str(tmp_path / "work"), device="cpu",
    )  # fmt: skip
    tr, _ = build_trainer(spec, DistInfo(), lambda record: None)
    tr.drafter.load_state_dict(drafter.state_dict())
    found = evaluate_batches(tr, [batch])
    # The same walk by the diagnosis' own path (each answer alone, draft ids mapped to target ids) with
    # no length cap, as the trainer walks; and the decoder's figure, where the cap of NEW tokens on two
    # of the answers (a last chain one draft shorter) happens not to bind.
    unpacked = diagnose(target, drafter, pairs, STEPS, max_new_tokens=10**9)
    assert found["rounds"] == unpacked["rounds"] == measured.verify_ct
    assert found["accept_length_rounds"] == pytest.approx(unpacked["simulated_accept_length"], abs=1e-4)
    assert found["accept_length_rounds"] == pytest.approx(measured.accept_length, abs=1e-4)
    assert found["accept_length"] > found["accept_length_rounds"] + 0.05  # the estimate the walk corrects
