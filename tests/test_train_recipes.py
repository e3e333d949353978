"""The recipe settings on the CPU at tiny shapes: per-sample loss normalisation (EAGLE-3 and DFlash),
a batch in samples (gradient accumulation), and the named recipes' settings, each trained a few steps."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from aerie.errors import ConfigError
from aerie.presets import load_config
from aerie.shards.format import HiddenSample
from aerie.shards.writer import ShardWriter
from aerie.train.config import TrainConfig
from aerie.train.data import Batch, SampleIndex
from aerie.train.dflash_objective import block_labels, block_loss, sample_anchors, slot_weights
from aerie.train.distributed import DistInfo
from aerie.train.loop import TrainSpec, build_trainer, objective_for, rows_per_step, run_training
from aerie.train.objective import supervised_rows, ttt_loss
from aerie.train.recipes import RECIPES, recipe
from aerie.train.teaching import Teacher, document_weights
from tests.test_dflash import CFG, V, packed_batch, random_drafter
from tests.test_train import _spec, small_cfg
from tests.test_train import tiny as tiny  # noqa: F401  (the module fixture, reused)
from tests.train_support import make_samples, tiny_target


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_document_weights_give_each_document_its_mean() -> None:
    docs = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    keep = torch.tensor([True, True, False, True, True, False, False, False, True])
    values = torch.arange(9, dtype=torch.float32)
    w = document_weights(docs, keep)
    means = [values[(docs == d) & keep].mean() for d in docs.unique() if ((docs == d) & keep).any()]
    assert float((w * values).sum()) == pytest.approx(float(sum(means)))
    assert float(w.sum()) == pytest.approx(len(means))
    assert bool((w[~keep] == 0).all())


def _ttt_inputs(lengths: list[int], steps: int = 3, vd: int = 20):
    batch = packed_batch(lengths, seed=1)
    t = batch.input_ids.shape[0]
    g = torch.Generator().manual_seed(2)
    logits = [torch.randn(t, vd, generator=g, requires_grad=True) for _ in range(steps)]
    probs = torch.softmax(torch.randn(t, vd, generator=g), -1)
    return batch, logits, probs, probs.argmax(-1), supervised_rows(batch, steps)


def test_sequence_normalisation_is_the_mean_over_documents_of_their_means() -> None:
    batch, logits, probs, argmax, valid = _ttt_inputs([30, 6, 14])
    decay = 0.8
    loss, stats = ttt_loss([x for x in logits], probs, argmax, valid, decay, documents=batch.doc_ids)
    expected = 0.0
    for k in range(3):
        n = valid[k].shape[0]
        ce = -(probs[1 + k : 1 + k + n] * torch.log_softmax(logits[k][:n].detach(), -1)).sum(-1)
        docs = batch.doc_ids[:n]
        means = [ce[(docs == d) & valid[k]].mean() for d in docs.unique() if ((docs == d) & valid[k]).any()]
        expected += decay**k * float(sum(means)) / len(means)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    token, token_stats = ttt_loss([x for x in logits], probs, argmax, valid, decay)
    assert float(token) != pytest.approx(expected, rel=1e-3)  # unequal documents: the two differ
    assert torch.equal(stats, token_stats)  # the metrics count tokens either way


def test_one_document_normalises_the_same_either_way() -> None:
    _, logits, probs, argmax, valid = _ttt_inputs([40])
    docs = torch.zeros(40, dtype=torch.int32)
    per_doc, _ = ttt_loss([x for x in logits], probs, argmax, valid, 0.8, documents=docs)
    per_token, _ = ttt_loss([x for x in logits], probs, argmax, valid, 0.8)
    assert float(per_doc) == pytest.approx(float(per_token), rel=1e-6)


def test_dflash_sequence_normalisation_averages_the_documents_losses() -> None:
    """Anchors whose whole blocks are supervised: the per-sample loss is the mean of each document's
    loss taken alone."""
    drafter = random_drafter().float()
    batch = packed_batch([24, 12], seed=3)
    batch = Batch(
        **{**batch.__dict__, "aux_hidden": batch.aux_hidden.float(), "last_hidden": batch.last_hidden.float()}
    )
    teacher = Teacher(drafter.head_weight * 10, torch.arange(V), torch.ones(V, dtype=torch.bool))
    anchors = sample_anchors(batch, 64, CFG.block_size, torch.Generator().manual_seed(0))
    anchors = anchors[block_labels(batch, anchors, CFG.block_size)[1].all(1)]
    docs = batch.doc_ids[anchors]
    assert docs.unique().numel() == 2 and (docs == 0).sum() != (docs == 1).sum()
    per_doc, _ = block_loss(drafter, teacher, batch, anchors, 7.0, per_document=True)
    alone = [float(block_loss(drafter, teacher, batch, anchors[docs == d], 7.0)[0]) for d in (0, 1)]
    assert float(per_doc) == pytest.approx(sum(alone) / 2, rel=1e-5)
    per_token, _ = block_loss(drafter, teacher, batch, anchors, 7.0)
    assert float(per_token) != pytest.approx(sum(alone) / 2, rel=1e-3)
    assert slot_weights(16, 7.0, torch.device("cpu"))[1] == pytest.approx(math.exp(-1 / 7))


def test_rows_per_step_hold_the_asked_samples_on_average() -> None:
    index = SampleIndex.of_samples(
        np.zeros(5, np.int32), np.zeros(5, np.int64), np.array([100, 300, 500, 900, 5000]), 8, "bf16"
    )
    mean = np.minimum(index.length, 1000).mean()  # samples are cut at max_length
    cfg = TrainConfig(batch_tokens=1000, max_length=1000, batch_sequences=64)
    assert rows_per_step(cfg, index, world=1) == round(64 * mean / 1000)
    assert rows_per_step(cfg, index, world=2) == round(64 * mean / 2000)
    assert rows_per_step(cfg.model_copy(update={"batch_sequences": None}), index, 1) == 1
    assert rows_per_step(cfg.model_copy(update={"batch_sequences": 1}), index, 1) == 1


def test_a_batch_of_samples_accumulates_rows_into_one_step(tiny, tmp_path) -> None:  # noqa: F811
    """4 samples of 48 tokens in rows of 48: 2 samples a step is 2 rows a step. The first step's loss is
    the mean of its two rows' losses at the initial weights, and the epochs' tokens are all trained."""
    cfg = small_cfg(batch_tokens=48, max_length=48, batch_sequences=2, epochs=2, eval_every=2)
    spec = _spec(tmp_path, tiny, cfg)
    records: list[dict] = []
    state = run_training(spec, DistInfo(), records.append)
    start = next(r for r in records if r["kind"] == "start")
    assert start["rows_per_step"] == 2 and start["total_steps"] == state.step == 4  # 8 rows, 2 a step
    assert state.tokens == 2 * 4 * 48

    tr, _ = build_trainer(spec, DistInfo(), lambda record: None)  # the same initial weights (seeded)
    rows = tr.source.batches(tr.train_plans, 0, 1, 2)
    losses = [
        float(tr.objective.loss(tr, tr.model, b.to(tr.device, tr.dtype), tr.dist.reduce, step=i)[0].detach())
        for i, b in enumerate(rows)
    ]
    first = next(r for r in records if r["kind"] == "train")
    assert first["step"] == 1 and first["loss"] == pytest.approx(sum(losses) / 2, rel=1e-5)


def test_sequence_normalised_training_learns(tiny, tmp_path) -> None:  # noqa: F811
    cfg = small_cfg(loss_normalization="sequence", epochs=30, eval_every=30, log_every=30)
    records: list[dict] = []
    run_training(_spec(tmp_path, tiny, cfg), DistInfo(), records.append)
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals[-1]["acc"][0] > evals[0]["acc"][0]


def test_every_recipe_loads_onto_a_preset_with_its_settings() -> None:
    for name, r in RECIPES.items():
        cfg = load_config("smollm2-local", list(r.overrides))
        for override in r.overrides:
            key, value = override.split("=", 1)
            node = cfg
            for part in key.split("."):
                node = getattr(node, part)
            got = getattr(node, "family", node)  # train.drafter=NAME names the section's family
            assert str(got).lower() == value or float(got) == pytest.approx(float(value)), (name, key, got)
    with pytest.raises(ConfigError, match="unknown training recipe 'nope'"):
        recipe("nope")


@torch.no_grad()
def _recaptured(model, samples: list[HiddenSample], layers: list[int]) -> list[HiddenSample]:
    """The samples with the outputs of `layers` as their captured features (DFlash's, not EAGLE-3's)."""
    out = []
    for s in samples:
        hs = model(s.input_ids[None], output_hidden_states=True).hidden_states  # hs[i + 1]: layer i's output
        aux = torch.cat([hs[i + 1][0] for i in layers], dim=-1)
        out.append(HiddenSample(s.id, s.input_ids, s.loss_mask, aux, s.last_hidden))
    return out


def _shards(samples: list[HiddenSample], out: Path, layers: int) -> list[str]:
    writer = ShardWriter(
        out,
        storage="bf16",
        shard_bytes=1 << 20,
        hidden_size=samples[0].last_hidden.shape[1],
        aux_layers=layers,
    )
    infos = [info for s in samples if (info := writer.add(s)) is not None]
    if (last := writer.close()) is not None:
        infos.append(last)
    return [str(i.path) for i in infos]


def _dflash_spec(
    tmp_path: Path, target, train: list[HiddenSample], held: list[HiddenSample], cfg: TrainConfig
) -> TrainSpec:
    """`tests.test_train._spec` for shards of DFlash's captured layers (the vocabulary map is unused)."""
    v = target.geometry.vocab_size
    vocab = tmp_path / "vocab.safetensors"
    save_file(
        {
            "used": torch.arange(v),
            "d2t": torch.zeros(v, dtype=torch.long),
            "t2d": torch.ones(v, dtype=torch.bool),
        },
        str(vocab),
    )
    layers = train[0].aux_hidden.shape[1] // target.geometry.hidden_size
    return TrainSpec(
        cfg=cfg,
        target=target,
        train_shards=_shards(train, tmp_path / "train", layers),
        eval_shards=_shards(held, tmp_path / "eval", layers),
        vocab_path=str(vocab),
        work_dir=str(tmp_path / "work"),
        device="cpu",
    )


def test_the_dflash_authors_recipe_trains_at_tiny_shapes(tmp_path) -> None:
    """Its block, layers, anchors, decay, schedule, batch in samples and per-sample loss, on a tiny target:
    the loop runs it, accumulates rows and keeps the best step by held-out acceptance."""
    r = recipe("dflash_authors")
    cfg = load_config("smollm2-local", list(r.overrides)).train
    update = {"epochs": 3.0, "batch_tokens": 48, "batch_sequences": 2, "eval_every": 2, "device": "cpu"}
    cfg = cfg.model_copy(update={**update, "checkpoint_every": 100, "log_every": 1})
    target, model = tiny_target(tmp_path)
    layers = cfg.capture_layers(target.geometry.num_layers)
    train = make_samples(model, target, 4, prompt=8, response=40, seed=0)
    held = make_samples(model, target, 2, prompt=8, response=40, seed=1)
    spec = _dflash_spec(
        tmp_path, target, _recaptured(model, train, layers), _recaptured(model, held, layers), cfg
    )
    records: list[dict] = []
    state = run_training(spec, DistInfo(), records.append)
    start = next(r for r in records if r["kind"] == "start")
    assert start["rows_per_step"] == 2
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals[-1]["acc"]) == 15  # a block of 16 drafts 15 slots
    assert state.best_step in {r["step"] for r in evals}
    assert objective_for(cfg).width == 15
