"""The draft model, its vocab map and its SGLang export."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from aerie.draft.attention import PAD_DOC, DocCausalMask, ttt_attention
from aerie.draft.export import EXPORT_KEYS, draft_config_for, export_drafter, load_drafter
from aerie.draft.model import DraftConfig, DraftKVCache, Eagle3Drafter
from aerie.draft.target_weights import load_embedding
from aerie.draft.vocab import build_vocab_map, counts_from_table, coverage_by_size
from aerie.errors import DataError, TargetError
from aerie.train.config import DraftShapeConfig
from tests.train_support import tiny_target

CFG = DraftConfig(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=100,
    draft_vocab_size=40,
    rope_theta=10000.0,
    max_position_embeddings=256,
    aux_layer_ids=(1, 3, 4),
)


def random_drafter(seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(CFG, torch.randn(CFG.vocab_size, CFG.hidden_size))
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2)
    return drafter.double()


def visibility_by_definition(doc: torch.Tensor, k: int) -> torch.Tensor:
    """[T, (k+1)T]: query (step k, row t) sees key (step j, row s) iff (j == 0, s <= t, same doc) or
    (1 <= j <= k, s == t). Built element by element, straight from the definition."""
    t = doc.numel()
    vis = torch.zeros(t, (k + 1) * t, dtype=torch.bool)
    for q in range(t):
        for j in range(k + 1):
            for s in range(t):
                vis[q, j * t + s] = (s <= q and bool(doc[s] == doc[q])) if j == 0 else s == q
    return vis


def dense_reference(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], vis: torch.Tensor
) -> torch.Tensor:
    group = q.shape[1] // keys[0].shape[1]
    k_all = torch.cat(keys).repeat_interleave(group, 1)  # [(k+1)T, nh, hd]
    v_all = torch.cat(values).repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q, k_all) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~vis, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v_all)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_ttt_attention_matches_visibility_definition(backend: str) -> None:
    torch.manual_seed(0)
    doc = torch.tensor([0] * 9 + [1] * 12 + [2] * 3)
    t, nh, nkv, hd, steps = doc.numel(), 4, 2, 8, 4
    dtype = torch.float64 if backend == "dense" else torch.float32  # eager flex runs in fp32
    qs = [torch.randn(t, nh, hd, dtype=dtype, requires_grad=True) for _ in range(steps)]
    ks = [torch.randn(t, nkv, hd, dtype=dtype, requires_grad=True) for _ in range(steps)]
    vs = [torch.randn(t, nkv, hd, dtype=dtype, requires_grad=True) for _ in range(steps)]
    mask = DocCausalMask(doc, backend)
    for k in range(steps):
        want = dense_reference(qs[k], ks[: k + 1], vs[: k + 1], visibility_by_definition(doc, k))
        if backend == "flex":  # eager flex on CPU has no backward; compare values only
            detached = [[x.detach() for x in xs[: k + 1]] for xs in (ks, vs)]
            got = ttt_attention(qs[k].detach(), detached[0], detached[1], mask)
            torch.testing.assert_close(got, want.detach(), atol=2e-5, rtol=1e-4)
            continue
        got = ttt_attention(qs[k], ks[: k + 1], vs[: k + 1], mask)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        # Gradients too: the log-sum-exp merge must be differentiable like the dense softmax.
        seed = torch.randn_like(got)
        grads = torch.autograd.grad((got * seed).sum(), [qs[k], *ks[: k + 1], *vs[: k + 1]])
        wants = torch.autograd.grad((want * seed).sum(), [qs[k], *ks[: k + 1], *vs[: k + 1]])
        for g, w in zip(grads, wants, strict=True):
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_packed_documents_do_not_see_each_other() -> None:
    """A document's logits are the same alone or packed after another one (positions kept)."""
    drafter = random_drafter()
    torch.manual_seed(1)
    a_len, b_len = 10, 14
    aux = torch.randn(a_len + b_len, 3 * CFG.hidden_size, dtype=torch.float64)
    ids = torch.randint(0, CFG.vocab_size, (a_len + b_len,))
    pos = torch.cat([torch.arange(a_len), torch.arange(b_len)])
    doc = torch.cat([torch.zeros(a_len), torch.ones(b_len)]).int()
    packed = drafter(aux, ids, pos, doc, ttt_length=3)
    alone = drafter(aux[a_len:], ids[a_len:], pos[a_len:], doc[a_len:], ttt_length=3)
    for k in range(3):  # rows whose step-k token x_{t+1+k} is still inside document b
        valid = b_len - 1 - k
        torch.testing.assert_close(packed[k][a_len : a_len + valid], alone[k][:valid])


def test_padding_is_skipped_without_changing_the_real_rows() -> None:
    """The dense path skips the padding document's attention: the real rows' logits and gradients equal
    those of the same rows packed without padding, and the padding rows stay finite (zeros, not NaN).
    Compared are the rows whose step-k token is still inside the document (the last ones shift past it)."""
    drafter = random_drafter()
    torch.manual_seed(3)
    real, pad, steps = 11, 7, 3
    valid = real - steps
    aux = torch.randn(real + pad, 3 * CFG.hidden_size, dtype=torch.float64)
    ids = torch.randint(0, CFG.vocab_size, (real + pad,))
    pos = torch.cat([torch.arange(real), torch.arange(pad)])
    doc = torch.cat([torch.zeros(real), torch.full((pad,), PAD_DOC)]).int()

    def real_rows_loss(n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        drafter.zero_grad()
        logits = drafter(aux[:n], ids[:n], pos[:n], doc[:n], ttt_length=steps)
        sum(step[:valid].logsumexp(-1).sum() for step in logits).backward()
        return [step.detach() for step in logits], [p.grad.clone() for p in drafter.parameters()]

    padded, padded_grads = real_rows_loss(real + pad)
    alone, alone_grads = real_rows_loss(real)
    for k in range(steps):
        torch.testing.assert_close(padded[k][:valid], alone[k][:valid])
        assert torch.isfinite(padded[k][real:]).all()
    for got, want in zip(padded_grads, alone_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_inference_chain_sees_what_training_saw() -> None:
    """Extend over rows 0..t then chain-draft k steps with `step` and a KV cache: the logits equal the
    TTT forward's step-k logits at row t. Training visibility == inference visibility."""
    drafter = random_drafter()
    torch.manual_seed(2)
    n, steps = 16, 4
    aux = torch.randn(n, 3 * CFG.hidden_size, dtype=torch.float64)
    ids = torch.randint(0, CFG.vocab_size, (n,))
    train_logits = drafter(aux, ids, torch.arange(n), torch.zeros(n, dtype=torch.int32), ttt_length=steps)
    for t in (0, 5, 9):
        cache = DraftKVCache(CFG, "cpu", torch.float64, capacity=4)
        logits, hidden = drafter.step(ids[1 : t + 2], aux[: t + 1], torch.arange(t + 1), cache)
        torch.testing.assert_close(logits[t], train_logits[0][t])
        for k in range(1, steps):  # teacher-forced chain: token x_{t+1+k} at position t+k
            logits, hidden = drafter.step(
                ids[t + 1 + k : t + 2 + k], hidden[-1:], torch.tensor([t + k]), cache
            )
            torch.testing.assert_close(logits[0], train_logits[k][t])
        cache.crop(t + 1)
        assert cache.length == t + 1


def test_vocab_map_top_counts_sorted_by_id() -> None:
    counts = torch.zeros(12, dtype=torch.int64)
    counts[[7, 2, 9, 4, 11]] = torch.tensor([50, 40, 40, 10, 5])
    vmap = build_vocab_map(counts, draft_vocab_size=3)
    assert vmap.used.tolist() == [2, 7, 9]  # top 3 (ties by id), sorted by id
    assert vmap.d2t.tolist() == [2, 6, 7]  # target = draft + d2t[draft]
    assert (torch.arange(3) + vmap.d2t).tolist() == [2, 7, 9]
    assert vmap.t2d.nonzero().flatten().tolist() == [2, 7, 9]
    assert vmap.coverage == pytest.approx(130 / 145)
    assert vmap.distinct_tokens == 5 and vmap.supervised_tokens == 145


def test_vocab_map_pads_with_unused_ids_and_caps_at_vocab() -> None:
    counts = torch.zeros(10, dtype=torch.int64)
    counts[[5, 8]] = torch.tensor([3, 1])
    vmap = build_vocab_map(counts, draft_vocab_size=4)
    assert vmap.used.tolist() == [0, 1, 5, 8]  # 2 seen + the 2 smallest unused ids
    assert vmap.coverage == 1.0
    assert build_vocab_map(counts, draft_vocab_size=32000).draft_vocab_size == 10


def test_vocab_coverage_by_size_of_answers() -> None:
    counts = torch.zeros(12, dtype=torch.int64)
    counts[[7, 2, 9, 4, 11]] = torch.tensor([50, 40, 40, 10, 5])
    answers = torch.tensor([7, 7, 2, 4, 11, 3])  # 3 never seen in training: only the whole vocab holds it
    # Vd 3 holds {2, 7, 9}; half of it {7}; twice it {2, 4, 7, 9, 11, 0} (padded with the smallest unused id).
    assert coverage_by_size(counts, answers, 3) == pytest.approx({1: 2 / 6, 3: 3 / 6, 6: 5 / 6, 12: 1.0})
    assert coverage_by_size(counts, answers, 12) == pytest.approx({6: 5 / 6, 12: 1.0})  # 2 x Vd > V: left out


def test_vocab_counts_table_outside_vocab() -> None:
    ids, counts = torch.tensor([0, 3, 12]), torch.tensor([4, 2, 0])
    assert counts_from_table(ids, counts, 10).tolist() == [4, 0, 0, 2, 0, 0, 0, 0, 0, 0]
    with pytest.raises(DataError, match="outside the target vocab"):
        counts_from_table(ids, torch.tensor([4, 2, 1]), 10)


def test_export_matches_the_sglang_contract_and_round_trips(tmp_path) -> None:
    target, _ = tiny_target(tmp_path)
    cfg = draft_config_for(target, draft_vocab_size=100)
    torch.manual_seed(3)
    drafter = Eagle3Drafter(cfg, load_embedding(target))
    counts = torch.randint(0, 50, (target.geometry.vocab_size,))
    vmap = build_vocab_map(counts, cfg.draft_vocab_size)
    drafter.set_vocab(vmap.d2t, vmap.t2d)
    out = export_drafter(drafter, tmp_path / "drafter", target, {"best_step": 7})

    config = json.loads((out / "config.json").read_text())
    n = target.geometry.num_layers
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [1, n // 2 - 1, n - 4],
        "use_aux_hidden_state": True,
    }
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["max_position_embeddings"] == target.geometry.max_position_embeddings == 1024
    assert config["vocab_size"] == 256 and config["draft_vocab_size"] == 100
    assert config["rope_theta"] == target.geometry.rope.theta and config["torch_dtype"] == "bfloat16"
    g = target.geometry
    for field, value in {
        "hidden_size": g.hidden_size,
        "intermediate_size": g.intermediate_size,
        "num_attention_heads": g.attention.num_heads,
        "num_key_value_heads": g.attention.num_kv_heads,
        "head_dim": g.attention.head_dim,
        "rms_norm_eps": g.rms_norm_eps,
    }.items():
        assert config[field] == value, field

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())  # noqa: SIM118
        assert keys == set(EXPORT_KEYS)
        assert not any("embed" in k for k in keys)
        for key, shape in EXPORT_KEYS.items():
            tensor = f.get_tensor(key)
            assert tuple(tensor.shape) == shape(cfg), key
            want = {"d2t": torch.int64, "t2d": torch.bool}.get(key, torch.bfloat16)
            assert tensor.dtype == want, key
        assert tuple(f.get_tensor("fc.weight").shape) == (64, 192)
        assert tuple(f.get_tensor("midlayer.self_attn.q_proj.weight").shape) == (64, 128)  # q reads 2H

    loaded = load_drafter(out, target, dtype=torch.float32)
    reference = drafter.to(torch.bfloat16).to(torch.float32)  # what the bf16 export can hold
    assert torch.equal(loaded.d2t, vmap.d2t) and torch.equal(loaded.t2d, vmap.t2d)
    assert torch.equal(loaded.embed_weight, load_embedding(target))  # the target's, attached on load
    torch.manual_seed(4)
    aux, ids = torch.randn(12, 192), torch.randint(0, 256, (12,))
    args = (aux, ids, torch.arange(12), torch.zeros(12, dtype=torch.int32), 2)
    reference.embed_weight = load_embedding(target)
    for a, b in zip(loaded(*args), reference(*args), strict=True):
        torch.testing.assert_close(a, b)
    assert json.loads((out / "aerie.json").read_text())["best_step"] == 7


def test_load_refuses_a_drafter_for_another_target(tmp_path, smollm2) -> None:
    target, _ = tiny_target(tmp_path)
    drafter = Eagle3Drafter(draft_config_for(target, 64), load_embedding(target))
    out = export_drafter(drafter, tmp_path / "drafter", target)
    with pytest.raises(TargetError, match="hidden 64 / vocab 256"):
        load_drafter(out, smollm2)


def test_a_draft_shape_of_its_own_is_exported_and_loaded(tmp_path) -> None:
    target, _ = tiny_target(tmp_path)
    wide = 3 * target.geometry.intermediate_size
    shape = DraftShapeConfig(num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=wide)
    drafter = Eagle3Drafter(
        draft_config_for(target, 64, shape.resolve(target.geometry)), load_embedding(target)
    )
    out = export_drafter(drafter, tmp_path / "drafter", target)
    config = json.loads((out / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (2, 1, 16)
    assert config["intermediate_size"] == wide and config["hidden_size"] == target.geometry.hidden_size
    loaded = load_drafter(out, target, dtype=torch.float32)
    assert tuple(loaded.midlayer.mlp.up_proj.weight.shape) == (wide, target.geometry.hidden_size)
    assert tuple(loaded.midlayer.self_attn.k_proj.weight.shape) == (16, 2 * target.geometry.hidden_size)
