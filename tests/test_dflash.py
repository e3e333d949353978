"""The DFlash block drafter: its config, family entry, masks, model, objective, export and proposer."""

from __future__ import annotations

import json

import pydantic
import pytest
import torch
from safetensors import safe_open

from aerie.draft.dflash import ContextKV, DFlashConfig, DFlashDrafter, block_visibility
from aerie.draft.dflash_export import dflash_config_for, export_dflash, export_keys, load_dflash
from aerie.draft.target_weights import load_embedding, load_lm_head
from aerie.engine.speculative.decoder import SpecDecoder, greedy_reference
from aerie.engine.speculative.dflash import DFlashProposer
from aerie.errors import ConfigError, EvaluationError
from aerie.families import DFlashSettings, eagle3_layers, family, names, spread_layers
from aerie.targets import TargetInfo
from aerie.train.config import TrainConfig
from aerie.train.data import PAD_DOC, Batch
from aerie.train.dflash_objective import (
    block_hits,
    block_labels,
    block_loss,
    block_scores,
    sample_anchors,
    slot_weights,
)
from aerie.train.teaching import Teacher, summarize, walk_answers
from tests.train_support import tiny_target

H, V = 32, 64
CFG = DFlashConfig(
    hidden_size=H,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=V,
    mask_token_id=V - 1,
    num_target_layers=12,
    target_layer_ids=(1, 4, 9),
    block_size=4,
    num_layers=2,
    max_position_embeddings=256,
)


def random_drafter(seed: int = 0, cfg: DFlashConfig = CFG) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg, torch.randn(V, H), torch.randn(V, H) * 0.3)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2)
    return drafter.double()


def packed_batch(lengths: list[int], seed: int = 0, prompt: int = 2) -> Batch:
    """Documents of `lengths` back to back; the first `prompt` tokens of each are unsupervised."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    docs = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    mask = positions >= prompt
    return Batch(
        input_ids=torch.randint(0, V - 1, (t,), generator=g),
        loss_mask=mask,
        positions=positions,
        doc_ids=docs,
        aux_hidden=torch.randn(t, 3 * H, generator=g, dtype=torch.float64),
        last_hidden=torch.randn(t, H, generator=g, dtype=torch.float64),
        tokens=t,
    )


# -- config and family --------------------------------------------------------------------------------


def test_train_config_takes_the_dflash_family_and_refuses_unknown_fields() -> None:
    cfg = TrainConfig(drafter={"family": "dflash", "block_size": 16, "anchors_per_sequence": 64})
    assert isinstance(cfg.drafter, DFlashSettings)
    assert (cfg.drafter.family, cfg.drafter.block_size, cfg.drafter.num_target_layers) == ("dflash", 16, 5)
    with pytest.raises(pydantic.ValidationError, match="block: not a dflash setting"):
        TrainConfig(drafter={"family": "dflash", "block": 8})
    with pytest.raises(pydantic.ValidationError, match="not a eagle3 setting"):
        TrainConfig(drafter={"block_size": 8})  # the default family has no block
    with pytest.raises(pydantic.ValidationError):
        TrainConfig(drafter="medusa")


def test_capture_layers_per_family() -> None:
    assert spread_layers(36, 5) == [1, 9, 17, 25, 33]  # DFlash's published Qwen3-8B choice
    assert spread_layers(30, 5) == [1, 8, 14, 21, 27]  # SmolLM2-135M
    assert spread_layers(30, 1) == [15]
    assert eagle3_layers(30) == [1, 14, 26]
    with pytest.raises(ConfigError):
        spread_layers(6, 5)
    with pytest.raises(ConfigError):
        family("medusa")


def test_every_family_part_resolves() -> None:
    for fam in map(family, names()):
        for part in (fam.model, fam.objective, fam.export, fam.loader, fam.proposer):
            assert callable(part.load()), (fam.name, part.ref)


# -- masks and model ----------------------------------------------------------------------------------


def test_block_visibility_matches_its_definition() -> None:
    doc = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    anchors = torch.tensor([1, 3, 5])
    b = 2
    got = block_visibility(anchors, doc, b)
    t, a = doc.numel(), anchors.numel()
    want = torch.zeros(a * b, t + a * b, dtype=torch.bool)
    for q in range(a * b):
        anchor = int(anchors[q // b])
        for s in range(t):
            want[q, s] = s < anchor and bool(doc[s] == doc[anchor])
        for s in range(a * b):
            want[q, t + s] = s // b == q // b
    assert torch.equal(got, want)


def test_training_blocks_equal_inference_blocks() -> None:
    """A block in a packed row (many anchors, two documents) gives the logits `draft_block` gives
    against a context cache built incrementally: the masks and the cache agree."""
    drafter = random_drafter()
    batch = packed_batch([9, 7])
    anchors = torch.tensor([2, 5, 8, 11, 14])
    out = drafter(batch.aux_hidden, batch.input_ids, batch.positions, batch.doc_ids, anchors)
    train_logits = drafter.logits(out[:, 1:].reshape(-1, H)).view(len(anchors), CFG.block_size - 1, V)
    for i, a in enumerate(anchors.tolist()):
        start = 0 if a < 9 else 9
        cache = ContextKV(drafter)
        cache.extend(batch.aux_hidden[start : start + 2])  # in two pieces, as rounds extend it
        cache.extend(batch.aux_hidden[start + 2 : a])
        got = drafter.draft_block(int(batch.input_ids[a]), int(batch.positions[a]), cache)
        torch.testing.assert_close(got, train_logits[i], rtol=1e-9, atol=1e-9)


def test_mask_tokens_make_the_drafted_slots_differ_from_the_anchor_slot() -> None:
    drafter = random_drafter()
    ids = drafter.block_tokens(torch.tensor([5, 7]))
    assert ids.tolist() == [[5, V - 1, V - 1, V - 1], [7, V - 1, V - 1, V - 1]]


# -- objective ----------------------------------------------------------------------------------------


def test_anchors_are_followed_by_a_supervised_token_of_their_document() -> None:
    batch = packed_batch([6, 5, 3])
    batch.doc_ids[-3:] = PAD_DOC  # padding never anchors
    anchors = sample_anchors(
        batch, per_document=100, block_size=4, generator=torch.Generator().manual_seed(0)
    )
    # doc 0 rows 0..5 (supervised from row 2): anchors 1..4; doc 1 rows 6..10: 7..9
    assert anchors.tolist() == [1, 2, 3, 4, 7, 8, 9]
    few = sample_anchors(batch, per_document=2, block_size=4, generator=torch.Generator().manual_seed(0))
    assert len(few) == 4 and set(few.tolist()) <= set(anchors.tolist())


def test_block_labels_stop_at_the_document_end() -> None:
    batch = packed_batch([6, 5])
    rows, valid = block_labels(batch, torch.tensor([3, 9]), block_size=4)
    # anchor 3: slots predict x4, x5 (in doc 0) and x6 (doc 1: invalid); teacher rows 3, 4, (5)
    assert rows[0].tolist()[:2] == [3, 4] and valid[0].tolist() == [True, True, False]
    # anchor 9: x10 valid, x11 past the row
    assert valid[1].tolist() == [True, False, False]


def test_slot_weights_decay_from_one() -> None:
    w = slot_weights(4, 2.0, torch.device("cpu"))
    assert w[0] == 1.0 and torch.all(w[1:] < w[:-1])


def test_block_loss_learns_a_batch_and_its_metrics_add_up() -> None:
    torch.manual_seed(0)
    drafter = random_drafter().float()
    batch = packed_batch([20, 16], seed=3)
    batch = Batch(
        **{**batch.__dict__, "aux_hidden": batch.aux_hidden.float(), "last_hidden": batch.last_hidden.float()}
    )
    teacher = Teacher(drafter.head_weight * 10, torch.arange(V), torch.ones(V, dtype=torch.bool))
    anchors = sample_anchors(batch, 64, CFG.block_size, torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    first_loss, first_stats = block_loss(drafter, teacher, batch, anchors, loss_decay=4.0)
    for _ in range(60):
        loss, stats = block_loss(drafter, teacher, batch, anchors, loss_decay=4.0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert float(loss.detach()) < 0.7 * float(first_loss.detach())
    summary = summarize(stats)
    assert summary["supervised"] == block_labels(batch, anchors, CFG.block_size)[1].sum(0).tolist()
    acc = summary["acc"]
    assert isinstance(acc, list) and acc[0] > summarize(first_stats)["acc"][0]  # type: ignore[index]
    cond = summary["cond_acc"]
    assert isinstance(cond, list) and all(0 <= c <= 1 for c in cond)
    assert 1.0 <= float(summary["accept_length"]) <= CFG.block_size  # type: ignore[arg-type]


# -- export and proposer (a tiny real Llama target) -------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("dflash-target"))


def tiny_drafter(target: TargetInfo, block_size: int = 8, scale: float = 0.05) -> DFlashDrafter:
    cfg = dflash_config_for(
        target,
        target_layer_ids=spread_layers(target.geometry.num_layers, 5),
        block_size=block_size,
        num_layers=2,
        mask_token_id=None,
    )
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg, load_embedding(target), load_lm_head(target))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, scale)
    return drafter.eval()


def test_export_writes_what_sglang_loads_and_reads_back(tiny, tmp_path) -> None:
    target, _ = tiny
    drafter = tiny_drafter(target)
    out = export_dflash(drafter, tmp_path / "dflash", target)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["num_hidden_layers"] == 2 and config["tie_word_embeddings"] is False
    assert config["dflash_config"] == {
        "block_size": 8,
        "target_layer_ids": [1, 2, 3, 4, 5],
        "mask_token_id": target.geometry.vocab_size - 1,
        "num_target_layers": target.geometry.num_layers,
    }
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    assert shapes == export_keys(drafter.config)
    assert shapes["fc.weight"] == (target.geometry.hidden_size, 5 * target.geometry.hidden_size)
    assert not any("embed" in key or "lm_head" in key for key in shapes)
    loaded = load_dflash(out, target, dtype=torch.float32)
    state, back = drafter.state_dict(), loaded.state_dict()
    for key in export_keys(drafter.config):
        assert torch.equal(back[key], state[key].to(torch.bfloat16).float()), key
    assert torch.equal(loaded.head_weight, drafter.head_weight)  # the target's own head, attached


def test_dflash_proposer_is_lossless_and_drafts_a_block(tiny) -> None:
    target, model = tiny
    drafter = tiny_drafter(target, scale=0.3)
    proposer = DFlashProposer(drafter)
    assert proposer.aux_layers == [2, 3, 4, 5, 6]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.geometry.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 7)]
    decoder = SpecDecoder(model, proposer, num_steps=7, eos_token_ids=[0], aux_layers=proposer.aux_layers)
    outs = decoder.generate(prompts, 20)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.output_ids == greedy_reference(model, prompt, 20, [0])
        assert out.verify_ct >= 1 and len(out.reached) == 7
    assert proposer.caches == {}  # finished sequences are removed


def test_dflash_proposer_drafts_what_the_drafter_predicts(tiny) -> None:
    """A proposer's block is the drafter's argmax at slots 1..k over the verified context."""
    target, _ = tiny
    drafter = tiny_drafter(target, scale=0.3)
    proposer = DFlashProposer(drafter)
    aux = torch.randn(4, 5 * target.geometry.hidden_size)
    proposer.add([0], [[1, 2, 3, 4, 5]], [aux])
    cache = ContextKV(drafter)
    cache.extend(aux)
    want = drafter.draft_block(5, 4, cache).argmax(-1).tolist()
    assert proposer.propose([0], 3) == [want[:3]]
    assert proposer.propose([0], 50) == [want]  # at most block_size - 1 drafts
    proposer.advance([0], [[7, 8]], [torch.randn(2, 5 * target.geometry.hidden_size)])
    assert proposer.caches[0].length == 6 and proposer.last_token[0] == 8
    with pytest.raises(EvaluationError):
        proposer.advance([0], [[9]], [torch.randn(1, 3 * target.geometry.hidden_size)])


def test_a_drafter_trained_on_an_answer_drafts_it_back(tiny) -> None:
    """Training and serving agree on the alignment: a drafter fitted by `block_loss` on one target
    answer gets its drafts accepted when the evaluator decodes that prompt again."""
    target, model = tiny
    torch.manual_seed(0)
    drafter = tiny_drafter(target, scale=0.02).float().train()
    prompt = torch.randint(
        0, target.geometry.vocab_size, (6,), generator=torch.Generator().manual_seed(5)
    ).tolist()
    answer = greedy_reference(model, prompt, 30, [0])
    ids = torch.tensor([prompt + answer])
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    proposer = DFlashProposer(drafter)
    t = ids.shape[1]
    batch = Batch(
        input_ids=ids[0],
        loss_mask=torch.arange(t) >= len(prompt),
        positions=torch.arange(t),
        doc_ids=torch.zeros(t, dtype=torch.int32),
        aux_hidden=torch.cat([hs[i][0] for i in proposer.aux_layers], dim=-1),
        last_hidden=hs[-1][0],
        tokens=t,
    )
    teacher = Teacher(
        load_lm_head(target),
        torch.arange(target.geometry.vocab_size),
        torch.ones(target.geometry.vocab_size, dtype=torch.bool),
    )
    anchors = sample_anchors(batch, 512, drafter.config.block_size, torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(150):
        loss, _stats = block_loss(drafter, teacher, batch, anchors, loss_decay=4.0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    drafter.eval()
    decoder = SpecDecoder(model, proposer, num_steps=7, eos_token_ids=[0], aux_layers=proposer.aux_layers)
    (out,) = decoder.generate([prompt], 30)
    assert out.output_ids == answer
    # An untrained drafter gets about 1.0 (no draft accepted); the fitted one about 2.7 at 150 steps.
    assert out.spec_accept_length > 2.0, (out.spec_accept_length, out.accepted)
    # The held-out walk the trainer keeps the best drafter by: a block after every anchor, its hits walked
    # in rounds, walks the decoder's rounds (tokens after the prefill's first, as `accept_length` counts).
    every = sample_anchors(batch, t, drafter.config.block_size, torch.Generator())
    with torch.no_grad():
        _loss, _stats, correct = block_scores(drafter, teacher, batch, every, 4.0)
    rounds, tokens = walk_answers(batch, block_hits(every, correct, t))
    assert (rounds, tokens) == (out.verify_ct, len(out.output_ids) - 1)


def test_the_family_fields_leave_eagle3_stage_keys_as_they_were() -> None:
    from aerie.manifest import StageResult
    from aerie.train import work

    cfg = TrainConfig()
    up = StageResult.model_construct(manifest_sha256="a" * 64)
    target = TargetInfo.model_construct(revision="r")
    before = cfg.model_dump(mode="json", exclude=work._NOT_KEYED)
    before.pop("drafter")
    # EAGLE-3's own settings were shared keys at these defaults before they moved to train.drafter.
    shared = {"draft_vocab_size": 32000, "ttt_length": 7, "step_decay": 0.8, "init_head_from_target": True}
    before.update({**shared, "recompute": False})
    before.pop("source")  # training on shards is keyed as before there was a choice
    before.pop("online")
    before.pop("batch_sequences")  # settings added later are keyed only when set off their defaults
    before.pop("loss_normalization")
    assert work.key_of(cfg, target, up, up) == work.stage_key(work.STAGE, before, ["a" * 64, "a" * 64, "r"])
    dflash = TrainConfig(drafter="dflash")
    assert work.key_of(dflash, target, up, up) != work.key_of(cfg, target, up, up)
    # A DFlash run's key as it was when its settings were the section `train.dflash`.
    settings = dflash.drafter.model_dump(mode="json", exclude={"family"})
    old = {**before, "drafter": "dflash", "dflash": settings}
    assert work.key_of(dflash, target, up, up) == work.stage_key(work.STAGE, old, ["a" * 64, "a" * 64, "r"])
