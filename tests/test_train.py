"""The trainer: objective, packing, data, overfitting, exact resume, the whole stage (in-process and torchrun)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from aerie.draft.export import load_drafter
from aerie.draft.vocab import build_vocab_map
from aerie.errors import DataError, TrainingError
from aerie.families import Eagle3Settings
from aerie.store import StoreConfig, open_store
from aerie.train import fused, teaching, work
from aerie.train.config import DraftShapeConfig, TrainConfig
from aerie.train.data import PAD_DOC, Batch, BatchReader, EpochPlans, SampleIndex, plan_epoch
from aerie.train.distributed import DistInfo
from aerie.train.loop import TrainSpec, _indices, run_training
from aerie.train.objective import supervised_rows, ttt_loss
from aerie.train.teaching import Teacher, answer_spans, soft_cross_entropy, summarize, walk_answers
from tests.stage_work import staged
from tests.train_support import make_samples, make_upstream, tiny_target, write_shards

run_train = staged("train", work.run)

pytest_plugins = ("tests.s3_support",)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops on a shared 2-core host run ~10x faster on one thread than fighting for two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target, model = tiny_target(root)
    torch.set_num_threads(1)
    train = make_samples(model, target, n=4, prompt=8, response=40, seed=0)
    held = make_samples(model, target, n=2, prompt=8, response=40, seed=1)
    return target, train, held


def small_cfg(**over) -> TrainConfig:
    """A small EAGLE-3 training; its own settings (`train.drafter.*`) may be given beside the shared ones."""
    own = {k: over.pop(k) for k in list(over) if k in Eagle3Settings.model_fields}
    base = dict(
        drafter={"family": "eagle3", "draft_vocab_size": 256, "ttt_length": 3, **own}, epochs=4, lr=5e-3, batch_tokens=96, max_length=96,
        eval_every=4, checkpoint_every=4, log_every=1, device="cpu", warmup_ratio=0.05,
    )  # fmt: skip
    return TrainConfig(**{**base, **over})


def _reference_soft_ce(logits: torch.Tensor, probs: torch.Tensor, weight: torch.Tensor):
    """The definition, by autograd in fp32: ce = -sum p log_softmax(z) over probs' rows, and d(ce . w)/dz."""
    z = logits.detach().float().requires_grad_()
    m = probs.shape[0]
    ce = -(probs.float() * F.log_softmax(z[:m], -1)).sum(-1)
    (grad,) = torch.autograd.grad((ce * weight).sum(), z)
    return ce, grad


def _soft_ce_inputs(dtype: torch.dtype, n: int = 37, m: int = 35, vd: int = 50):
    """Logits [n, vd]; probs [m, vd] whose rows sum to anything in [0, 1.5) (0 included), not just 1."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(n, vd, generator=g)).to(dtype)
    mass = 1.5 * torch.rand(m, 1, generator=g)
    mass[3] = 0.0  # a row with no target mass at all
    probs = (torch.softmax(2 * torch.randn(m, vd, generator=g), -1) * mass).to(dtype)
    return logits, probs, torch.rand(m, generator=g)


@pytest.mark.parametrize("chunk_rows", [1000, 8, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_cross_entropy_matches_autograd_reference(dtype, chunk_rows, monkeypatch) -> None:
    """Forward ce, argmax and the gradient (scaled by a per-row grad_ce) against the definition: rows whose
    probs do not sum to 1, rows past probs (no target: ce 0, gradient 0), one chunk or many."""
    monkeypatch.setattr(fused, "EAGER_CHUNK_ELEMENTS", chunk_rows * 50)
    logits, probs, weight = _soft_ce_inputs(dtype)
    z = logits.clone().requires_grad_()
    ce, argmax = soft_cross_entropy(z, probs)
    (grad,) = torch.autograd.grad((ce[:35] * weight).sum(), z)
    ref_ce, ref_grad = _reference_soft_ce(logits, probs, weight)
    assert grad.dtype == dtype and ce.shape == argmax.shape == (37,)
    torch.testing.assert_close(ce[:35], ref_ce, atol=2e-5, rtol=1e-5)
    assert ce[35:].tolist() == [0.0, 0.0]
    assert torch.equal(argmax, logits.argmax(-1))
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: the gradient is rounded, then scaled (2 ulp)
    torch.testing.assert_close(grad.float(), ref_grad, atol=tol, rtol=tol)
    assert not grad[35:].any()


def test_fusable_soft_ce_math_matches_eager() -> None:
    """The function inductor compiles on CUDA computes what eager does (run eagerly here, no compiler)."""
    for dtype in (torch.float32, torch.bfloat16):
        logits, probs, _ = _soft_ce_inputs(dtype, n=35)
        g_eager, g_fusable = torch.empty_like(logits), torch.empty_like(logits)
        ce, top = fused.soft_ce_rows_eager(logits, probs, g_eager)
        ce_f, top_f = fused.soft_ce_rows_fusable(logits, probs, g_fusable)
        torch.testing.assert_close(ce_f, ce, atol=2e-5, rtol=1e-5)
        assert torch.equal(top_f, top)
        tol = 1e-6 if dtype == torch.float32 else 8e-3  # one bf16 ulp of values up to 1.5
        torch.testing.assert_close(g_fusable.float(), g_eager.float(), atol=tol, rtol=0)


def test_teacher_distribution_is_softmax_and_argmax_of_fp32_logits(monkeypatch) -> None:
    monkeypatch.setattr(fused, "EAGER_CHUNK_ELEMENTS", 7 * 40)  # 7-row chunks over 30 rows
    g = torch.Generator().manual_seed(1)
    lm_head, hidden = torch.randn(64, 16, generator=g), torch.randn(30, 16, generator=g)
    used = torch.arange(0, 64, 64 // 40)[:40]
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[used] = True
    probs, argmax = Teacher(lm_head, used, t2d).distribution(hidden, torch.bfloat16)
    logits = hidden @ lm_head[used].T
    assert probs.dtype == torch.bfloat16
    torch.testing.assert_close(probs.float(), torch.softmax(logits, -1), atol=4e-3, rtol=0)
    assert torch.equal(argmax, logits.argmax(-1))


def _kernel(fusable, backend: str = "eager") -> fused.FusedKernel:
    """The soft-CE kernel compiled on CPU (dynamo's "eager" backend by default: no C++ compiler needed)."""
    agree = fused.soft_ce_agree
    return fused.FusedKernel(
        "ce", fused.soft_ce_rows_eager, fusable, agree, devices=("cpu",), backend=backend
    )


def test_fused_kernel_falls_back_to_eager_once_and_says_why(caplog) -> None:
    """A kernel that cannot compile (a graph break under fullgraph) runs eagerly, warns once, says why."""

    def unfusable(z, p, g_out):
        torch._dynamo.graph_break()
        return fused.soft_ce_rows_fusable(z, p, g_out)

    kernel = _kernel(unfusable)
    logits, probs, _ = _soft_ce_inputs(torch.float32, n=35)
    g, g_ref = torch.empty_like(logits), torch.empty_like(logits)
    with caplog.at_level(logging.WARNING, logger="aerie.train.fused"):
        for _ in range(2):
            ce, top = kernel(logits, probs, g)
    ce_ref, top_ref = fused.soft_ce_rows_eager(logits, probs, g_ref)
    assert torch.equal(ce, ce_ref) and torch.equal(top, top_ref) and torch.equal(g, g_ref)
    assert [r.message for r in caplog.records if "eager from now on" in r.message] == [
        f"fused ce kernel unusable, eager from now on: {kernel.failure}"
    ]
    assert kernel.failure.startswith("Unsupported: ") and "graph_break()" in kernel.failure
    assert fused.fused_backend([kernel]) == f"ce: eager fallback ({kernel.failure})"
    assert not kernel.compiles_on(logits.device) and not kernel.ran_compiled


def test_fused_kernel_that_disagrees_with_eager_is_not_used() -> None:
    """A kernel that compiles but computes something else is caught on its first chunk: eager results."""

    def wrong(z, p, g_out):
        ce, top = fused.soft_ce_rows_fusable(z, p, g_out)
        return ce + 0.5, top

    kernel, good = _kernel(wrong), _kernel(fused.soft_ce_rows_fusable)
    logits, probs, _ = _soft_ce_inputs(torch.float32, n=35)
    ce, _ = kernel(logits, probs, torch.empty_like(logits))
    ce_ref, _ = fused.soft_ce_rows_eager(logits, probs, torch.empty_like(logits))
    assert torch.equal(ce, ce_ref)
    assert "cross-entropy differs from eager" in kernel.failure
    good(logits, probs, torch.empty_like(logits))
    assert good.ran_compiled and not good.failure
    assert fused.fused_backend([good]) == "compiled (eager)"  # by dynamo's "eager" backend


def _inductor_cpu_missing() -> str:
    """Why inductor cannot build CPU kernels here ("" when it can)."""
    try:
        from torch._inductor import cpp_builder

        return "" if shutil.which(cpp_builder.get_cpp_compiler()) else "no C++ compiler for inductor on PATH"
    except Exception as exc:  # noqa: BLE001 - any failure to find one means: skip
        return f"inductor's C++ compiler lookup failed: {exc!r}"


@pytest.mark.slow
def test_inductor_kernels_match_eager_through_the_objective(monkeypatch) -> None:
    """The production kernels compiled by inductor (on CPU here; CUDA in training) through the autograd
    function and the teacher, chunked (a short last chunk: a second, dynamic-rows graph): same as eager."""
    missing = _inductor_cpu_missing()
    if missing:
        pytest.skip(missing)
    ce_kernel = _kernel(fused.soft_ce_rows_fusable, backend="inductor")
    teacher_kernel = fused.FusedKernel(
        "teacher", fused.teacher_rows, fused.teacher_rows, fused.teacher_agree, devices=("cpu",)
    )
    monkeypatch.setattr(fused, "FUSED_CHUNK_ELEMENTS", 16 * 50)  # 16-row chunks: 16, 16, 3
    logits, probs, weight = _soft_ce_inputs(torch.bfloat16)
    results = []
    for kernel in (ce_kernel, fused.FusedKernel("ce", fused.soft_ce_rows_eager, fused.soft_ce_rows_eager,
                                                 fused.soft_ce_agree, devices=())):  # fmt: skip
        monkeypatch.setattr(teaching, "SOFT_CE", kernel)
        z = logits.clone().requires_grad_()
        ce, argmax = soft_cross_entropy(z, probs)
        (grad,) = torch.autograd.grad((ce[:35] * weight).sum(), z)
        results.append((ce, argmax, grad))
    (ce, argmax, grad), (ce_e, argmax_e, grad_e) = results
    assert ce_kernel.ran_compiled and not ce_kernel.failure, ce_kernel.failure
    torch.testing.assert_close(ce, ce_e, atol=1e-4, rtol=1e-5)
    assert torch.equal(logits.gather(-1, argmax[:, None]), logits.gather(-1, argmax_e[:, None]))
    torch.testing.assert_close(grad.float(), grad_e.float(), atol=4e-3, rtol=0)

    monkeypatch.setattr(teaching, "TEACHER", teacher_kernel)
    g = torch.Generator().manual_seed(2)
    lm_head, hidden = torch.randn(64, 16, generator=g), torch.randn(35, 16, generator=g)
    used, t2d = torch.arange(50), torch.ones(64, dtype=torch.bool)
    probs_c, argmax_c = Teacher(lm_head, used, t2d).distribution(hidden, torch.bfloat16)
    assert teacher_kernel.ran_compiled and not teacher_kernel.failure, teacher_kernel.failure
    logits_t = hidden @ lm_head[:50].T
    torch.testing.assert_close(probs_c.float(), torch.softmax(logits_t, -1), atol=4e-3, rtol=0)
    assert torch.equal(argmax_c, logits_t.argmax(-1))
    assert fused.fused_backend([ce_kernel, teacher_kernel]) == "inductor"


def test_conditional_accuracy_and_acceptance_length() -> None:
    """Hand-made right/wrong patterns over 3 TTT steps: acc, cond_acc and 1 + sum_k prod_{j<=k} cond_acc."""
    t, vd = 12, 5
    teacher_argmax = torch.arange(t) % vd
    probs = F.one_hot(teacher_argmax, vd).float()
    patterns = [
        [1, 1, 1, 0, 1, 1, 0, 1, 1, 1],  # step 0: rows 0..9
        [1, 0, 1, 1, 1, 1, 1, 0, 1],  # step 1: rows 0..8
        [1, 1, 0, 1, 1, 0, 1, 1],  # step 2: rows 0..7
    ]
    logits, valid = [], []
    for k, pattern in enumerate(patterns):
        n = t - 2 - k
        target = teacher_argmax[1 + k : 1 + k + n]
        guess = torch.where(torch.tensor(pattern, dtype=torch.bool), target, (target + 1) % vd)
        logits.append(torch.cat([F.one_hot(guess, vd).float() * 5, torch.zeros(t - n, vd)]))
        valid.append(torch.ones(n, dtype=torch.bool))
    _, stats = ttt_loss(logits, probs, teacher_argmax, valid, step_decay=0.8)
    summary = summarize(stats)
    assert summary["acc"] == pytest.approx([8 / 10, 7 / 9, 6 / 8])
    # step 1 among rows 0..8 right at step 0 (0,1,2,4,5,7,8): right at 0,2,4,5,8 -> 5/7
    # step 2 among rows 0..7 right at steps 0 and 1 (0,2,4,5): right at 0,4 -> 2/4
    assert summary["cond_acc"] == pytest.approx([8 / 10, 5 / 7, 2 / 4])
    c = [8 / 10, 5 / 7, 2 / 4]
    assert summary["accept_length"] == pytest.approx(1 + c[0] + c[0] * c[1] + c[0] * c[1] * c[2])


def _mask_batch(loss_mask: list[int], doc_ids: list[int]) -> Batch:
    """A packed row with only what the alignment reads: which tokens are supervised, in which document."""
    t = len(loss_mask)
    return Batch(
        input_ids=torch.zeros(t, dtype=torch.int64),
        loss_mask=torch.tensor(loss_mask, dtype=torch.bool),
        positions=torch.arange(t),
        doc_ids=torch.tensor(doc_ids, dtype=torch.int32),
        aux_hidden=torch.zeros(t, 0),
        last_hidden=torch.zeros(t, 0),
        tokens=t,
    )


def test_answer_spans_split_at_documents_and_turns() -> None:
    batch = _mask_batch(
        #  0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
        [1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 3, -1, -1],
    )
    # doc 0 opens the row with answer tokens (a cut-off remainder): its first token has no row to draft
    # from; doc 1 has two turns; doc 2's answer ends at the document, doc 3 follows straight on.
    assert answer_spans(batch) == [(1, 3), (5, 7), (8, 10), (11, 12), (13, 14)]


def test_round_walk_is_below_the_per_position_estimate_when_misses_cluster() -> None:
    """One answer x2..x11 after a 2-token prompt, 2 TTT steps, with a miss usually followed by another:
    rounds start right after a miss, so they see the hard positions more often than the average does."""
    t, vd = 12, 5
    teacher_argmax = torch.arange(t) % vd
    probs = F.one_hot(teacher_argmax, vd).float()
    patterns = [
        [1, 1, 0, 0, 1, 1, 0, 0, 1, 1],  # step 0, rows 0..9: row t names x_{t+2}
        [1, 0, 0, 0, 1, 0, 0, 0, 1],  # step 1, rows 0..8: row t names x_{t+3}
    ]
    logits = []
    for k, pattern in enumerate(patterns):
        n = t - 2 - k
        target = teacher_argmax[1 + k : 1 + k + n]
        guess = torch.where(torch.tensor(pattern, dtype=torch.bool), target, (target + 1) % vd)
        logits.append(torch.cat([F.one_hot(guess, vd).float() * 5, torch.zeros(t - n, vd)]))
    batch = _mask_batch([0, 0] + [1] * 10, [0] * t)
    hits: list[torch.Tensor] = []
    _, stats = ttt_loss(logits, probs, teacher_argmax, supervised_rows(batch, 2), 0.8, hits=hits)
    assert [h.int().tolist() for h in hits] == patterns
    # x2 comes from the prefill. Rounds: row 1 (1 drafted right, step 1 wrong), row 3 (miss), row 4 (both),
    # row 7 (miss), row 8 (both, to x11): 5 rounds for the 9 tokens after x2.
    assert walk_answers(batch, hits) == (5, 9)
    per_position = summarize(stats)["accept_length"]
    assert per_position == pytest.approx(1 + 6 / 10 + 6 / 10 * 3 / 5)  # 1.96
    assert per_position > 9 / 5
    # A second copy of the answer in the same row, as its own document: twice the rounds and tokens.
    two = _mask_batch(([0, 0] + [1] * 10) * 2, [0] * t + [1] * t)
    doubled = [torch.cat([h, torch.zeros(t, dtype=torch.bool)]) for h in hits]
    for k, h in enumerate(hits):
        doubled[k][t : t + h.shape[0]] = h
    assert walk_answers(two, doubled) == (10, 18)


def test_packing_covers_every_token_once_and_fills_rows() -> None:
    lengths = np.array([5, 40, 7, 100, 3, 22])
    rows = plan_epoch(lengths, batch_tokens=32, max_length=64, seed=3, epoch=0)
    covered: dict[int, list[int]] = {}
    for row in rows:
        for p in row:
            covered.setdefault(p.sample, []).extend(range(p.start, p.start + p.length))
    for sample, length in enumerate(lengths):
        assert sorted(covered[sample]) == list(range(min(int(length), 64)))  # truncated to max_length
    assert all(sum(p.length for p in row) == 32 for row in rows[:-1])  # only the last row is short
    again = plan_epoch(lengths, batch_tokens=32, max_length=64, seed=3, epoch=0)
    assert again == rows
    assert plan_epoch(lengths, batch_tokens=32, max_length=64, seed=3, epoch=1) != rows


def test_supervised_rows_follow_the_alignment(tiny, tmp_path) -> None:
    """Row t at step k predicts x_{t+2+k}: supervised iff that token is in the row's document and masked in."""
    target, train, _ = tiny
    paths = write_shards(train[:2], tmp_path)
    index = SampleIndex(paths)
    plans = EpochPlans(index, batch_tokens=100, max_length=64, seed=0, shuffle=False)
    batch = BatchReader(index).batch(plans.pieces(0), 100)
    assert batch.tokens == 96 and batch.doc_ids[-4:].tolist() == [PAD_DOC] * 4
    assert batch.positions[:48].tolist() == list(range(48)) and batch.positions[48:96].tolist() == list(
        range(48)
    )
    valid = supervised_rows(batch, 3)
    for k in range(3):
        for t in range(valid[k].numel()):
            j = t + 2 + k
            want = (
                bool(batch.doc_ids[j] == batch.doc_ids[t])
                and bool(batch.loss_mask[j])
                and batch.doc_ids[t] >= 0
            )
            assert bool(valid[k][t]) == want
    assert int(valid[0].sum()) == 2 * 40  # every supervised token of both docs is some row's step-0 target


def test_fp8_shards_read_close_to_bf16(tiny, tmp_path) -> None:
    _, train, _ = tiny
    rows = {}
    for storage in ("bf16", "fp8"):
        index = SampleIndex(write_shards(train, tmp_path / storage, storage))
        assert index.storage == storage
        plans = EpochPlans(index, batch_tokens=64, max_length=48, seed=0)
        rows[storage] = BatchReader(index).batch(plans.pieces(1), 64).to("cpu", torch.float32)
    a, b = rows["bf16"], rows["fp8"]
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.doc_ids, b.doc_ids)
    for x, y in ((a.aux_hidden, b.aux_hidden), (a.last_hidden, b.last_hidden)):
        assert ((x - y).abs() <= 0.07 * x.abs().amax(-1, keepdim=True) + 1e-6).all()  # e4m3: 3 mantissa bits


def test_unreadable_shard_is_named(tmp_path) -> None:
    bad = tmp_path / "shard-00000.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(DataError, match="shard-00000"):
        SampleIndex([bad])


def _spec(tmp_path: Path, tiny, cfg: TrainConfig, eval_split: bool = True) -> TrainSpec:
    from safetensors.torch import save_file

    target, train, held = tiny
    counts = sum(torch.bincount(s.input_ids[s.loss_mask], minlength=256) for s in train)
    vmap = build_vocab_map(counts, cfg.drafter.draft_vocab_size)
    save_file({"used": vmap.used, "d2t": vmap.d2t, "t2d": vmap.t2d}, str(tmp_path / "vocab.safetensors"))
    return TrainSpec(
        cfg=cfg,
        target=target,
        train_shards=[str(p) for p in write_shards(train, tmp_path / "train")],
        eval_shards=[str(p) for p in write_shards(train, tmp_path / "eval")] if eval_split else [],
        vocab_path=str(tmp_path / "vocab.safetensors"),
        work_dir=str(tmp_path / "work"),
        device="cpu",
    )


def test_tiny_set_overfits(tiny, tmp_path) -> None:
    """Evaluated on its own 4 training samples, step-0 accuracy passes 0.9 (full-vocab argmax, exact)."""
    cfg = small_cfg(epochs=100, eval_every=50, checkpoint_every=1000, log_every=50)
    records: list[dict] = []
    state = run_training(_spec(tmp_path, tiny, cfg), DistInfo(), records.append)
    evals = [r for r in records if r["kind"] == "eval"]
    assert state.step == 200 and evals[-1]["step"] == 200
    assert evals[-1]["acc"][0] > 0.9, evals[-1]
    assert evals[-1]["accept_length"] > evals[0]["accept_length"]
    assert evals[-1]["accept_length_rounds"] > evals[0]["accept_length_rounds"]
    # 4 answers of 40 tokens: 39 verify tokens each, at most ttt_length + 1 of them per round.
    assert all(4 * 39 / (3 + 1) <= r["rounds"] <= 4 * 39 for r in evals)
    best = max(evals, key=lambda r: r["accept_length_rounds"])  # the first of equals, as the loop keeps
    assert (state.best_step, state.best_accept_length_rounds) == (best["step"], best["accept_length_rounds"])


def test_heldout_comes_from_train_without_an_eval_split(tiny, tmp_path) -> None:
    spec = _spec(tmp_path, tiny, small_cfg(heldout_samples=1), eval_split=False)
    train_index, eval_index = _indices(spec)
    assert (len(train_index), len(eval_index)) == (3, 1)
    assert set(eval_index.begin.tolist()).isdisjoint(train_index.begin.tolist())


def test_train_fraction_keeps_the_first_share_of_the_train_samples(tiny, tmp_path) -> None:
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    full, held = _indices(_spec(tmp_path / "a", tiny, small_cfg()))
    half, held_too = _indices(_spec(tmp_path / "b", tiny, small_cfg(train_fraction=0.5)))
    assert (len(full), len(half)) == (4, 2) and half.tokens == int(full.length[:2].sum())
    assert held_too.tokens == held.tokens  # the held-out samples are not cut


def test_stage_trains_exports_and_caches(tiny, tmp_path) -> None:
    target, train, held = tiny
    up = make_upstream(tmp_path, target, train, held, storage="fp8")
    seen: list[tuple[float, str]] = []
    cfg = small_cfg(draft_vocab_size=128, epochs=6)
    result = run_train(
        cfg, store=up.store, run_name="t", target=target, shards=up.shards, corpus=up.corpus,
        progress=lambda f, m: seen.append((f, m)),
    )  # fmt: skip
    assert not result.cache_hit and result.stage == "train"
    manifest = json.loads(up.store.get_bytes(f"{result.prefix}/manifest.json"))
    assert manifest["vocab"]["draft_vocab_size"] == 128 and 0 < manifest["vocab"]["vocab_coverage"] <= 1
    assert manifest["best"]["accept_length"] >= 1.0 and manifest["best"]["step"] in (4, 8, 12)
    evals = {r["step"]: r for r in map(json.loads, up.store.get_bytes(f"{result.prefix}/metrics.jsonl").splitlines())
             if r["kind"] == "eval"}  # fmt: skip
    best = evals[manifest["best"]["step"]]
    assert best["accept_length_rounds"] == max(r["accept_length_rounds"] for r in evals.values())
    assert manifest["best"] == {k: best[k] for k in ("step", "accept_length_rounds", "accept_length")}
    assert result.figures["accept_length_rounds"] == best["accept_length_rounds"]
    assert manifest["training"]["total_steps"] == 12  # 4 samples x 48 tokens = 2 rows of 96, x 6 epochs
    assert (
        manifest["drafter_config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        == target.aux_layers_output
    )
    files = set(up.store.list(result.prefix))
    for name in ("drafter/config.json", "drafter/model.safetensors", "metrics.jsonl", "loss.png", "accuracy.png",
                 "checkpoints/latest.json", "checkpoints/best/model.safetensors"):  # fmt: skip
        assert f"{result.prefix}/{name}" in files, name
    steps = sorted({k.split("/")[-2] for k in files if "/checkpoints/step-" in k})
    assert steps == ["step-00000008", "step-00000012"]  # keep_checkpoints=2 pruned step 4
    drafter = load_drafter(Path(up.store.root) / result.prefix / "drafter", target, dtype=torch.float32)
    assert drafter.lm_head.weight.shape == (128, 64)
    assert (
        drafter.config.intermediate_size == target.geometry.intermediate_size
    )  # by default, the target's width
    lines = [
        json.loads(x) for x in up.store.get_bytes(f"{result.prefix}/metrics.jsonl").decode().splitlines()
    ]
    assert [r["step"] for r in lines if r["kind"] == "train"] == list(range(1, 13))
    assert seen[-1][0] == 1.0 and any("eval accept length" in m for _, m in seen)

    again = run_train(cfg, store=up.store, run_name="t", target=target, shards=up.shards, corpus=up.corpus)
    assert again.cache_hit and again.key == result.key and again.figures == result.figures


@pytest.mark.integration
def test_stage_on_s3_downloads_shards_and_uploads_everything(tiny, tmp_path, s3_config: StoreConfig) -> None:
    """An S3 store (a real moto server): shards are downloaded once into the cache, results go back to S3."""
    target, train, held = tiny
    store = open_store(s3_config)
    up = make_upstream(tmp_path, target, train, held, store=store)
    # A draft MLP narrower than the target's (128): the exported drafter must carry its own width.
    cfg = small_cfg(epochs=2, cache_dir=str(tmp_path / "cache"), draft=DraftShapeConfig(intermediate_size=96))
    result = run_train(cfg, store=store, run_name="t", target=target, shards=up.shards, corpus=up.corpus)
    cached = sorted(p.name for p in (tmp_path / "cache" / "shards").rglob("*.safetensors"))
    assert cached == ["shard-00000.safetensors", "shard-00000.safetensors"]  # one train, one eval
    # The downloaded shards stay for the next training; the local work (checkpoints, optimizer state)
    # is gone once everything is in the store.
    assert not (tmp_path / "cache" / "work" / "t" / result.key).exists()
    for name in ("drafter/model.safetensors", "checkpoints/latest.json", "metrics.jsonl", "manifest.json"):
        assert store.exists(f"{result.prefix}/{name}"), name
    local = tmp_path / "drafter"
    for name in ("config.json", "model.safetensors"):
        store.get_file(f"{result.prefix}/drafter/{name}", local / name)
    assert json.loads((local / "config.json").read_text())["intermediate_size"] == 96
    drafter = load_drafter(local, target)
    assert drafter.config.draft_vocab_size == 256 and drafter.midlayer.mlp.up_proj.weight.shape == (96, 64)


class Crash(Exception):
    pass


def _run(up, cfg, target, **kw):
    return run_train(
        cfg, store=up.store, run_name="t", target=target, shards=up.shards, corpus=up.corpus, **kw
    )


def _train_records(up, result) -> list[dict]:
    lines = up.store.get_bytes(f"{result.prefix}/metrics.jsonl").decode().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def _same_losses(a: list[dict], b: list[dict]) -> None:
    """Each of steps 1..8 trained once in both, with the same losses."""
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 9))
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=1e-5, atol=1e-6)


def test_resume_continues_exactly(tiny, tmp_path) -> None:
    """8 steps straight vs 4 steps, a crash, and a re-run that resumes from the store: same losses."""
    target, train, held = tiny
    cfg = small_cfg(epochs=4, eval_every=2)
    straight = make_upstream(tmp_path / "a", target, train, held)
    done = _run(straight, cfg, target)

    interrupted = make_upstream(tmp_path / "b", target, train, held)

    def crash_after_step_5(fraction: float, message: str) -> None:
        if message.startswith("step 5/"):
            raise Crash(message)

    with pytest.raises(Crash):
        _run(interrupted, cfg, target, progress=crash_after_step_5)
    latest = json.loads(interrupted.store.get_bytes(f"t/train/{done.key}/checkpoints/latest.json"))
    assert latest["step"] == 4
    checkpoint = json.loads(
        interrupted.store.get_bytes(f"t/train/{done.key}/checkpoints/step-00000004/trainer.json")
    )
    resumed = _run(interrupted, cfg, target)
    assert resumed.key == done.key
    _same_losses(_train_records(straight, done), _train_records(interrupted, resumed))
    assert resumed.figures["accept_length"] == pytest.approx(done.figures["accept_length"], rel=1e-5)

    # The wall time covers both runs: the resumed run starts from the checkpoint's elapsed seconds.
    def training(up, result) -> dict:
        return json.loads(up.store.get_bytes(f"{result.prefix}/manifest.json"))["training"]

    assert checkpoint["state"]["runs"] == 1 and checkpoint["state"]["elapsed_s"] > 0
    assert training(straight, done)["runs"] == 1 and training(interrupted, resumed)["runs"] == 2
    assert training(interrupted, resumed)["wall_s"] > checkpoint["state"]["elapsed_s"]
    assert resumed.figures["train_wall_s"] == training(interrupted, resumed)["wall_s"]


def test_a_second_training_of_one_key_is_refused_and_a_killed_holder_blocks_nothing(tiny, tmp_path) -> None:
    """Another process (here a real one) holding this key's training lock: the training fails at once
    naming it and trains nothing; once that process is SIGKILLed, the re-run trains."""
    target, train, held = tiny
    up = make_upstream(tmp_path, target, train, held)
    cfg = small_cfg(epochs=1, cache_dir=str(tmp_path / "cache"))
    key = work.key_of(cfg, target, up.shards, up.corpus)
    lock = tmp_path / "cache" / "work" / "t" / f".lock-{key}"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom aerie.hostlock import HostLock\n"
         "lock = HostLock(sys.argv[1]); lock.acquire(); print('held', flush=True); time.sleep(600)", str(lock)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(TrainingError, match=f"another process \\(pid {holder.pid}\\) is training into"):
            _run(up, cfg, target)
        assert not up.store.list(f"t/train/{key}")  # nothing written for the refused one
    finally:
        holder.kill()
        holder.wait()
    result = _run(up, cfg, target)
    assert result.key == key and not result.cache_hit and up.store.exists(f"{result.prefix}/manifest.json")


def test_a_sigterm_stops_at_the_step_boundary_with_a_checkpoint_and_the_rerun_continues_exactly(
    tiny, tmp_path
) -> None:
    """A real SIGTERM to this process mid-training (the GPU host's budget, a spot notice), with the GPU
    host's handler installed (SIGTERM -> SystemExit): the loop finishes step 5, checkpoints it although
    checkpoints fall every 4 steps, then exits as the handler says; the re-run loses no step."""
    target, cfg, straight, done, stopped = _straight_and_stopped(tiny, tmp_path)
    code, messages = _sigterm_at(stopped, cfg, target, "step 5/")
    assert code == 128 + signal.SIGTERM
    assert any("stopped by signal" in m and "at step 5" in m for m in messages)
    latest = json.loads(stopped.store.get_bytes(f"t/train/{done.key}/checkpoints/latest.json"))
    assert latest["step"] == 5  # not 4: nothing after the last regular checkpoint is lost

    records = _train_records(stopped, _run(stopped, cfg, target))
    _same_losses(_train_records(straight, done), records)  # each step once: none redone
    assert [r["runs"] for r in records] == [1] * 5 + [2] * 3


def _straight_and_stopped(tiny, tmp_path):  # noqa: ANN001, ANN202
    """The signal tests' two stores: one trained uninterrupted (its result `done`) and one not yet
    trained, for the run a signal stops; with the target and the config both use."""
    target, train, held = tiny
    cfg = small_cfg(epochs=4, eval_every=2)
    straight = make_upstream(tmp_path / "a", target, train, held)
    done = _run(straight, cfg, target)
    return target, cfg, straight, done, make_upstream(tmp_path / "b", target, train, held)


def _sigterm_at(upstream, cfg, target, prefix: str) -> tuple[object, list[str]]:  # noqa: ANN001
    """Train with a real SIGTERM sent to this process when a progress message starts with `prefix`,
    under the GPU host's handler (SIGTERM -> SystemExit): the exit code and every progress message."""
    messages: list[str] = []

    def term_at(fraction: float, message: str) -> None:
        messages.append(message)
        if message.startswith(prefix):
            os.kill(os.getpid(), signal.SIGTERM)

    def host_handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, host_handler)
    try:
        with pytest.raises(SystemExit) as exited:
            _run(upstream, cfg, target, progress=term_at)
        assert signal.getsignal(signal.SIGTERM) is host_handler  # the loop gave the handler back
    finally:
        signal.signal(signal.SIGTERM, previous)
    return exited.value.code, messages


def test_a_sigterm_during_the_last_step_stops_with_its_checkpoint_and_the_rerun_only_exports(
    tiny, tmp_path
) -> None:
    """A SIGTERM while the last step is still evaluated: the process ends as asked (no export after
    it), the last step's checkpoint is in the store, and the re-run trains no step and exports the same
    drafter as an uninterrupted run."""
    target, cfg, straight, done, stopped = _straight_and_stopped(tiny, tmp_path)
    # At the step's record: its evaluation and checkpoint follow.
    code, messages = _sigterm_at(stopped, cfg, target, "step 8/8 ")
    assert code == 128 + signal.SIGTERM
    assert any("stopped by signal" in m and "at step 8" in m for m in messages)
    assert not any("exporting" in m for m in messages)
    prefix = f"t/train/{done.key}"
    assert json.loads(stopped.store.get_bytes(f"{prefix}/checkpoints/latest.json"))["step"] == 8
    assert not stopped.store.exists(f"{prefix}/manifest.json")

    rerun_messages: list[str] = []
    resumed = _run(stopped, cfg, target, progress=lambda f, m: rerun_messages.append(m))
    assert not any(m.startswith("step ") and "loss" in m for m in rerun_messages)  # no step trained again
    records = _train_records(stopped, resumed)
    _same_losses(_train_records(straight, done), records)
    assert [r["runs"] for r in records] == [1] * 8
    assert resumed.figures["best_step"] == done.figures["best_step"]
    assert resumed.figures["accept_length_rounds"] == pytest.approx(done.figures["accept_length_rounds"])


@pytest.mark.slow
@pytest.mark.integration
def test_torchrun_workers_train_with_ddp(tiny, tmp_path) -> None:
    """num_gpus=2 on a CPU host: two gloo ranks under torchrun, records tailed, checkpoints uploaded."""
    target, train, held = tiny
    up = make_upstream(tmp_path, target, train, held)
    cfg = small_cfg(epochs=4, num_gpus=2, eval_every=2, checkpoint_every=2)
    result = run_train(cfg, store=up.store, run_name="t", target=target, shards=up.shards, corpus=up.corpus)
    manifest = json.loads(up.store.get_bytes(f"{result.prefix}/manifest.json"))
    assert manifest["training"]["total_steps"] == 4  # 8 rows over 2 ranks
    assert manifest["training"]["tokens"] == 4 * 2 * 96
    lines = [
        json.loads(x) for x in up.store.get_bytes(f"{result.prefix}/metrics.jsonl").decode().splitlines()
    ]
    evals = [r for r in lines if r["kind"] == "eval"]
    # Eval splits the held-out rows over the ranks and sums: every supervised row counted exactly once.
    assert evals[0]["supervised"][0] == 2 * 40
    assert up.store.exists(f"{result.prefix}/drafter/model.safetensors")


def test_shards_for_another_layer_convention_are_refused(tiny) -> None:
    target, _, _ = tiny
    with pytest.raises(DataError, match="output-of-layer ids"):
        work._check_extract({"layers": {"output_of_layer": target.aux_layers_input}}, target, TrainConfig())
    with pytest.raises(DataError, match="hidden size 128"):
        work._check_extract({"hidden_size": 128}, target, TrainConfig())
    eagle3 = {"layers": {"output_of_layer": target.aux_layers_output}, "hidden_size": 64}
    work._check_extract(eagle3, target, TrainConfig())
    # EAGLE-3's three layers do not feed a DFlash drafter, which reads its own.
    with pytest.raises(DataError, match="a train.drafter=dflash drafter reads"):
        work._check_extract(eagle3, target, TrainConfig(drafter={"family": "dflash", "num_target_layers": 3}))
