"""Thinking at its real length: a reasoning turn longer than the old 4,096-token limit is kept whole by
the corpus and by the trainer's packing at the new limit (checked by decoding its masks), packed
documents never see each other, the blocked CPU attention and the recomputed unroll give the same
numbers as the plain ones, and acceptance by output position adds up to the whole measurement's."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
import torch

from aerie.corpus.encoding import BatchEncoder, EncodeOptions
from aerie.corpus.lengths import LengthStats
from aerie.corpus.shuffle import Layout
from aerie.corpus.template import TemplateSpec
from aerie.draft.attention import BlockAttention, blocked_causal_attention
from aerie.draft.model import DraftConfig, Eagle3Drafter
from aerie.engine.speculative.decoder import SpecDecoder, SpecStats
from aerie.engine.speculative.prompt_lookup import PromptLookupProposer
from aerie.evaluate.positions import BUCKETS, NAMES, PositionCounts, bucket_of
from aerie.presets import kimi_k25_8gpu
from aerie.reasoning import PARSERS
from aerie.train.config import TrainConfig
from aerie.train.data import plan_epoch
from tests.corpus_support import decoded_runs, msg, task_batch, tokenizer_with_template
from tests.test_thinking import KIMI, KIMI_SPECIAL, QWEN3, THINK_TAGS

OLD_LIMIT = 4096
NEW_LIMIT = 32768


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared CI box: one intra-op thread avoids spin-wait contention
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def targets(smollm2):
    """The tiny Qwen3 and Kimi-K2.5 chat formats (their templates and tags on the embedded tokenizer)."""
    tokenizer = smollm2.load_tokenizer()
    return {
        "qwen3": (tokenizer_with_template(tokenizer, QWEN3, THINK_TAGS), PARSERS["qwen3"]),
        "kimi": (tokenizer_with_template(tokenizer, KIMI, KIMI_SPECIAL), PARSERS["kimi_k2"]),
    }


def _long_reasoning(steps: int) -> str:
    return " ".join(f"Step {i}: carry the {i % 7} and check the sum again." for i in range(steps))


def _encode(tokenizer, parser, conversation, max_length: int):
    spec = TemplateSpec.from_tokenizer(tokenizer, parser=parser)
    options = EncodeOptions(
        max_length=max_length,
        truncated_policy="keep",
        history_mismatch="split",
        layout=Layout(0, 0.0, (1, 0)),
    )
    return BatchEncoder(spec, options)(task_batch([conversation], id=["long"]))


@pytest.mark.parametrize("family", ["qwen3", "kimi"])
def test_a_reasoning_turn_longer_than_the_old_limit_is_trained_whole_at_the_new_one(targets, family):
    tokenizer, parser = targets[family]
    reasoning = _long_reasoning(450)  # about 6,300 tokens: past the old 4,096
    conversation = [
        msg("user", "Add these numbers."),
        msg("assistant", "The sum is 42.", reasoning=reasoning),
    ]

    cut = _encode(tokenizer, parser, conversation, OLD_LIMIT).frame.row(0, named=True)
    assert cut["n_tokens"] == OLD_LIMIT < cut["n_tokens_full"]
    assert cut["n_reasoning_supervised"] < cut["n_reasoning"]
    stats = LengthStats()
    stats.add(_encode(tokenizer, parser, conversation, OLD_LIMIT).frame)
    summary = stats.summary(OLD_LIMIT)
    assert summary["samples_over_max_length"] == 1
    assert summary["reasoning_kept_fraction"] < 1.0
    assert summary["supervised_kept_fraction"] == pytest.approx(
        cut["n_supervised"] / cut["n_supervised_full"], abs=1e-4
    )

    frame = _encode(tokenizer, parser, conversation, NEW_LIMIT).frame
    whole = frame.row(0, named=True)
    assert whole["n_tokens"] == whole["n_tokens_full"] > OLD_LIMIT
    assert whole["n_reasoning_supervised"] == whole["n_reasoning"] > OLD_LIMIT
    runs = decoded_runs(tokenizer, whole["input_ids"], whole["loss_mask"])
    assert len(runs) == 1  # the whole turn, its reasoning and its answer, is one supervised run
    assert reasoning in runs[0] and runs[0].index(reasoning) < runs[0].index("The sum is 42.")
    assert "Add these numbers." not in runs[0]
    stats = LengthStats()
    stats.add(frame)
    summary = stats.summary(NEW_LIMIT)
    assert summary["samples_over_max_length"] == 0
    assert summary["supervised_kept_fraction"] == summary["reasoning_kept_fraction"] == 1.0

    # The trainer's rows at the new limit: the sample is one piece, all of it, even behind a shorter one.
    lengths = np.array([1500, whole["n_tokens"]])
    cfg = TrainConfig(max_length=NEW_LIMIT, batch_tokens=NEW_LIMIT, split_samples=False)
    rows = plan_epoch(lengths, cfg.batch_tokens, cfg.max_length, seed=0, epoch=0, shuffle=False, whole=True)
    pieces = [p for row in rows for p in row if p.sample == 1]
    assert [(p.start, p.length) for p in pieces] == [(0, whole["n_tokens"])]


def test_packing_whole_never_splits_a_sample_that_fits_a_row():
    lengths = np.random.default_rng(0).integers(100, 9000, size=200)
    split = plan_epoch(lengths, 8192, 8192, seed=1, epoch=0)
    kept = plan_epoch(lengths, 8192, 8192, seed=1, epoch=0, whole=True)
    pieces = [p for row in kept for p in row]
    assert sorted(p.sample for p in pieces) == list(range(200))  # one piece per sample
    assert all(p.start == 0 and p.length == min(lengths[p.sample], 8192) for p in pieces)
    assert all(sum(p.length for p in row) <= 8192 for row in kept)
    assert sum(len(row) for row in split) > 200  # the default cuts samples at row ends


def test_split_samples_false_needs_rows_that_hold_the_longest_sample():
    with pytest.raises(ValueError, match="batch_tokens 4096 is below train.max_length 8192"):
        TrainConfig(max_length=8192, batch_tokens=4096, split_samples=False)


def _reference_attention(q, k, v):
    """Plain causal softmax attention of one document, the [L, L] way: out, lse."""
    t, nh, hd = q.shape
    g = nh // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = torch.einsum("tnd,snd->nts", q, kk) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    lse = scores.logsumexp(-1)
    return torch.einsum("nts,snd->tnd", (scores - lse[..., None]).exp(), vv), lse.T


def test_blocked_attention_matches_plain_attention_and_its_gradients():
    torch.manual_seed(0)
    q, k, v = (torch.randn(200, h, 16, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    w_out, w_lse = torch.randn(200, 4, 16, dtype=torch.float64), torch.randn(200, 4, dtype=torch.float64)

    def grads(fn):
        out, lse = fn(q, k, v)
        ((out * w_out).sum() + (lse * w_lse).sum()).backward()
        found = [out.detach(), lse.detach(), *(x.grad.clone() for x in (q, k, v))]
        for x in (q, k, v):
            x.grad = None
        return found

    expected = grads(_reference_attention)
    for rows in (32, 64, 200):  # blocks of several sizes, one ending mid-way
        for got, want in zip(
            grads(lambda *a, r=rows: blocked_causal_attention(*a, rows=r)), expected, strict=True
        ):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The backward is the function's own (the lse's gradient included): gradcheck in float64.
    small = [x.detach()[:40].requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda a, b, c: BlockAttention.apply(a[24:], b, c, 24), small)


def _drafter() -> Eagle3Drafter:
    cfg = DraftConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        vocab_size=128, draft_vocab_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return Eagle3Drafter(cfg, torch.randn(128, 32) * 0.1)


def test_packed_documents_never_see_each_other():
    drafter = _drafter()
    g = torch.Generator().manual_seed(1)
    lengths = [70, 130, 50]
    ids = torch.randint(0, 128, (sum(lengths),), generator=g)
    aux = torch.randn(sum(lengths), 96, generator=g)
    docs = torch.cat([torch.full((n,), d, dtype=torch.int32) for d, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    packed = drafter(aux, ids, positions, docs, 3)
    start = 0
    for n in lengths:
        alone = drafter(aux[start : start + n], ids[start : start + n], positions[start : start + n],
                        torch.zeros(n, dtype=torch.int32), 3)  # fmt: skip
        for step, (a, b) in enumerate(zip(alone, packed, strict=True)):
            # Step k's rows whose teacher-forced token stays inside the document (the rest are masked).
            valid = n - 1 - step
            torch.testing.assert_close(b[start : start + valid], a[:valid], rtol=1e-4, atol=1e-5)
        start += n
    # Changing one document moves none of the others' logits.
    other = ids.clone()
    other[70:200] = torch.randint(0, 128, (130,), generator=g)
    moved = drafter(aux, other, positions, docs, 3)
    torch.testing.assert_close(moved[2][:67], packed[2][:67])
    torch.testing.assert_close(moved[2][200:247], packed[2][200:247])


def test_recomputing_the_unroll_gives_the_same_loss_and_gradients():
    drafter = _drafter()
    g = torch.Generator().manual_seed(2)
    ids, aux = torch.randint(0, 128, (90,), generator=g), torch.randn(90, 96, generator=g)
    docs = torch.cat([torch.zeros(40, dtype=torch.int32), torch.ones(50, dtype=torch.int32)])
    positions = torch.cat([torch.arange(40), torch.arange(50)])

    def run(recompute: bool):
        drafter.zero_grad()
        logits = drafter(aux, ids, positions, docs, 4, recompute=recompute)
        loss = sum((x.log_softmax(-1)[:, :5].sum() * (k + 1)) for k, x in enumerate(logits))
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}

    plain, recomputed = run(False), run(True)
    torch.testing.assert_close(recomputed[0], plain[0])
    for name, grad in plain[1].items():
        torch.testing.assert_close(recomputed[1][name], grad, msg=name)


def test_position_buckets_add_up_to_the_whole_acceptance(smollm2):
    """A real decode (the embedded target, prompt lookup) counted in small buckets, so a short output
    crosses all of them; the buckets partition its rounds and tokens."""
    target = smollm2.load_model("cpu", "float32")
    tok = smollm2.load_tokenizer()
    prompts = [
        list(tok(t).input_ids) for t in ("Count: 1, 2, 3, 4, 5, 6,", "Repeat: the cat sat. the cat sat.")
    ]
    decoder = SpecDecoder(target, PromptLookupProposer(), num_steps=3, eos_token_ids=[])
    outputs = decoder.generate(prompts, 48)
    buckets = ((0, 8), (8, 24), (24, None))
    stats, counts = SpecStats(3), PositionCounts(buckets)
    for out in outputs:
        stats.add(out)
        counts.add(out)
    by_position = counts.to_dict()
    assert list(by_position) == ["0-8", "8-24", "24+"]
    assert all(b["rounds"] > 0 for b in by_position.values())
    assert sum(b["rounds"] for b in by_position.values()) == stats.verify_ct
    assert sum(b["tokens"] for b in by_position.values()) == stats.verify_tokens
    weighted = sum(b["accept_length"] * b["rounds"] for b in by_position.values()) / stats.verify_ct
    assert weighted == pytest.approx(stats.accept_length, abs=1e-3)


def test_the_report_buckets_are_the_ones_users_read():
    assert NAMES == ("0-512", "512-2K", "2K-8K", "8K+")
    assert [bucket_of(p) for p in (0, 511, 512, 2047, 2048, 8191, 8192, 10**6)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len(BUCKETS) == len(NAMES)


def test_the_kimi_preset_trains_every_token_of_a_turn_at_its_limits():
    cfg = kimi_k25_8gpu()
    cap = max(d.sampling.max_tokens for d in cfg.generate.datasets)
    assert cfg.corpus.max_length == cfg.train.max_length > cap > OLD_LIMIT
    # Rows no longer than the step measured to fit; a longer sample goes on over the next rows.
    assert cfg.train.batch_tokens <= 16384 and cfg.train.split_samples and cfg.train.drafter.recompute
    assert cfg.evaluate.max_new_tokens >= 8192  # reaches the last position bucket


def test_a_frame_without_reasoning_keeps_everything():
    frame = pl.DataFrame(
        {"n_tokens_full": [10, 20], "n_supervised_full": [4, 8], "n_supervised": [4, 8],
         "n_reasoning": [0, 0], "n_reasoning_supervised": [0, 0]}
    )  # fmt: skip
    stats = LengthStats()
    stats.add(frame)
    summary = stats.summary(64)
    assert summary["reasoning"]["count"] == 0 and summary["reasoning_kept_fraction"] == 1.0
    assert summary["samples"]["max"] == 20 and summary["supervised_tokens_kept"] == 12


def test_the_kimi_plan_prints_what_its_limits_keep(roomy_disk):
    from aerie.plan.plan import make_plan
    from aerie.plan.render import table

    plan = make_plan(kimi_k25_8gpu())
    text = table(plan)
    assert plan.lengths is not None
    line = next(x for x in text.splitlines() if "reasoning tokens kept" in x)
    assert f"{plan.lengths.reasoning_kept:.1%}" in line and "max_tokens 28,672" in line
    assert plan.lengths.reasoning_kept > 0.99  # what the preset's comment says it chose the limits for
    assert plan.record()["lengths"]["max_length"] == 32768
    # The old limits keep far less of a turn that reasons for its whole budget.
    old = kimi_k25_8gpu()
    old.corpus.max_length = old.train.max_length = OLD_LIMIT
    for d in old.generate.datasets:
        d.sampling.max_tokens = OLD_LIMIT
    assert make_plan(old).lengths.reasoning_kept < plan.lengths.reasoning_kept  # type: ignore[union-attr]
