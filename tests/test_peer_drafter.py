"""benchmarks/quality/peer_drafter.py on the CPU: a run's train split and settings found in its store, aerie's
shards in SpecForge's layout (ids and teacher states shifted left by one, fp8 dequantized as the reader
does), SpecForge's epoch shuffle, and a drafter state with SpecForge's key names exported into the
directory aerie's evaluator loads. The state comes from aerie's own drafter (same key names as SpecForge's
`LlamaForCausalLMEagle3`): SpecForge's step itself needs triton + CUDA, so its training is not run here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from aerie.draft.export import draft_config_for, load_drafter
from aerie.draft.model import Eagle3Drafter
from aerie.draft.target_weights import load_embedding
from aerie.errors import DataError, TargetError
from aerie.manifest import StageDir
from aerie.shards.reader import ShardReader
from aerie.store import LocalStore
from tests.train_support import make_samples, make_upstream, tiny_target, write_shards

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "quality"))
import peer_drafter  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("peer")
    target, model = tiny_target(root)
    samples = make_samples(model, target, n=3, prompt=5, response=7)
    write_shards(samples, root / "shards")
    return root, target, samples


def test_rows_are_specforge_layout(tiny):
    root, target, samples = tiny
    rows = list(peer_drafter.specforge_rows(peer_drafter.shard_paths(root / "shards"), max_len=10))
    assert len(rows) == len(samples)
    for row, s in zip(rows, samples, strict=True):
        n = 10  # 12 tokens cut to max_len
        assert row["input_ids"].shape == (1, n) and row["hidden_states"].shape == (
            1,
            n,
            3 * target.geometry.hidden_size,
        )
        assert torch.equal(row["input_ids"][0, :-1], s.input_ids[1:n].long())
        assert row["input_ids"][0, -1] == 0
        assert torch.equal(row["target_hidden"][0, :-1], s.last_hidden[1:n].to(torch.bfloat16))
        assert torch.equal(row["hidden_states"][0], s.aux_hidden[:n].to(torch.bfloat16))
        assert row["loss_mask"].shape == (1, n, 1)
        assert torch.equal(row["loss_mask"][0, :, 0].bool(), s.loss_mask[:n])


def test_export_round_trips_through_aerie_loader(tiny, tmp_path):
    root, target, _ = tiny
    cfg = draft_config_for(target, draft_vocab_size=64)
    torch.manual_seed(1)
    drafter = Eagle3Drafter(cfg, load_embedding(target, torch.float32))
    used = torch.arange(0, 128, 2)
    t2d = torch.zeros(target.geometry.vocab_size, dtype=torch.bool)
    t2d[used] = True
    drafter.set_vocab(used - torch.arange(64), t2d)
    state = dict(drafter.state_dict())
    state["embed_tokens.weight"] = torch.zeros(
        target.geometry.vocab_size, target.geometry.hidden_size
    )  # SpecForge keeps it
    out = peer_drafter.export_specforge(state, cfg, target, tmp_path / "sf", {"note": "test"})
    loaded = load_drafter(out, target, dtype=torch.float32)
    for key, value in loaded.state_dict().items():
        if key in state and key != "embed_tokens.weight":
            assert torch.equal(value, state[key].to(torch.bfloat16).to(value.dtype)), key
    with pytest.raises(TargetError, match="not exportable.*fc_norm"):
        peer_drafter.export_specforge(
            {**state, "fc_norm.0.weight": torch.ones(1)}, cfg, target, tmp_path / "x", {}
        )


def test_cosine_schedule_warms_up_then_decays():
    lrs = [peer_drafter.cosine_lr(s, 1000) for s in range(1000)]
    assert lrs[0] < lrs[14] == pytest.approx(peer_drafter.SPECFORGE_LR)
    assert lrs[-1] < 1e-6 and max(lrs) <= peer_drafter.SPECFORGE_LR


@pytest.fixture(scope="module")
def run_store(tiny):
    """A store holding a run's extract stage (fp8 shards, train and eval splits) and a finished train
    stage's manifest naming the target and aerie's training settings."""
    root, target, samples = tiny
    store = LocalStore(root / "store")
    make_upstream(root / "up", target, samples[:2], samples[2:], storage="fp8", store=store)
    train = {"name": target.name, "revision": target.revision}
    StageDir(store, "t", "train", "k-train").finish(
        {"target": train, "training": {"config": {"epochs": 2.0, "max_length": 2048}}}
    )
    return root / "store"


def test_locate_takes_the_train_split_and_aerie_settings(tiny, run_store):
    _, target, _ = tiny
    inputs = peer_drafter.locate(run_store, "t")
    assert [p.parent.name for p in inputs.train_shards] == ["train"] * len(inputs.train_shards)
    assert sum(len(ShardReader(p)) for p in inputs.train_shards) == 2
    assert (inputs.epochs, inputs.max_len) == (2.0, 2048)
    assert inputs.target.revision == target.revision
    assert inputs.drafter_dir == run_store / "t" / "train" / "k-train" / "drafter"
    with pytest.raises(DataError, match="expected one finished train stage, found 0"):
        peer_drafter.locate(run_store, "other-run")


def test_fp8_rows_hold_what_the_reader_dequantizes(run_store):
    paths = peer_drafter.locate(run_store, "t").train_shards
    expected = [s for p in paths for s in ShardReader(p)]
    rows = list(peer_drafter.specforge_rows(paths, max_len=64))
    assert len(rows) == len(expected) == 2
    for row, s in zip(rows, expected, strict=True):
        assert torch.equal(row["hidden_states"][0], s.aux_hidden)
        assert torch.equal(row["target_hidden"][0, :-1], s.last_hidden[1:])
        assert not row["target_hidden"][0, -1].any()


def test_epoch_order_is_a_seeded_permutation_per_epoch():
    first, again, second = (peer_drafter.epoch_order(50, 0, e) for e in (0, 0, 1))
    assert first == again and sorted(first) == list(range(50))
    assert first != second and first != list(range(50))
