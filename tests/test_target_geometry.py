"""One target geometry for every architecture's config shape, and the drafter shape it defaults to.

The configs are transformers' own config classes saved without weights (seeded sizes, tiny), plus the
Kimi-K2.5 config.json aerie ships for planning; the target resolves from its directory as a real one does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import DeepseekV3Config, GptOssConfig, LlamaConfig, Qwen3Config, Qwen3MoeConfig

from aerie.draft.export import draft_config_for, hf_config
from aerie.errors import TargetError
from aerie.plan.facts import target_facts
from aerie.targets import TargetConfig, geometry_from_config, geometry_of, known_target_dir, resolve_target
from aerie.train.config import DraftShapeConfig

KIMI = known_target_dir("moonshotai/Kimi-K2.5")
SMALL = {"vocab_size": 512, "max_position_embeddings": 4096, "num_hidden_layers": 4}


def saved(tmp_path: Path, config: object) -> Path:
    config.save_pretrained(tmp_path)  # type: ignore[attr-defined]
    return tmp_path


def test_llama3_gqa_with_llama3_rope(tmp_path) -> None:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024, "rope_theta": 500000.0}  # fmt: skip
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=160,
                      rope_parameters=rope, **SMALL)  # fmt: skip
    g = geometry_of(saved(tmp_path, cfg))
    assert (g.attention.kind, g.attention.num_heads, g.attention.num_kv_heads, g.attention.head_dim) == (
        "gqa", 8, 2, 8)  # fmt: skip
    assert g.rope.theta == 500000.0 and g.rope.scaling is not None
    assert g.rope.scaling["rope_type"] == "llama3" and g.rope.scaling["factor"] == 8.0
    assert g.moe is None and g.params()[0] == g.params()[1]
    shape = g.default_drafter()
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size) == (8, 2, 8, 160)
    assert shape.rope == g.rope


def test_qwen3_head_dim_is_not_hidden_over_heads(tmp_path) -> None:
    cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      intermediate_size=96, **SMALL)  # fmt: skip
    target = resolve_target(TargetConfig(name=str(saved(tmp_path, cfg))))
    assert (
        target.geometry.attention.head_dim
        == 32
        != target.geometry.hidden_size // target.geometry.attention.num_heads
    )
    draft = draft_config_for(target, 100)
    assert (draft.num_attention_heads, draft.num_key_value_heads, draft.head_dim) == (4, 2, 32)
    exported = hf_config(draft, target)
    assert exported["head_dim"] == 32 and exported["hidden_size"] == 64


def test_qwen3_moe_counts_and_active_params(tmp_path) -> None:
    cfg = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                         num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[3], **SMALL)  # fmt: skip
    g = geometry_of(saved(tmp_path, cfg))
    assert g.moe is not None
    assert (g.moe.num_experts, g.moe.active_experts, g.moe.shared_experts) == (8, 2, 0)
    assert g.moe.moe_layers == (1,)  # (i + 1) % 2 == 0 is layers 1 and 3; 3 is dense by mlp_only_layers
    total, active = g.params()
    assert total - active == 6 * 3 * 64 * 32  # one MoE layer, 8 - 2 experts never run for a token
    assert g.default_drafter().intermediate_size == 128  # the dense MLP's, as SpecForge's Qwen3-30B drafter


def test_deepseek_v3_mla_ignores_transformers_head_dim(tmp_path) -> None:
    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
                           moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                           n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_group=1, topk_group=1,
                           **SMALL)  # fmt: skip
    folder = saved(tmp_path, cfg)
    assert json.loads((folder / "config.json").read_text())["head_dim"] == 8  # the rope part, not a head
    target = resolve_target(TargetConfig(name=str(folder)))
    att = target.geometry.attention
    assert (att.kind, att.head_dim, att.v_head_dim, att.kv_lora_rank, att.q_lora_rank) == (
        "mla",
        24,
        12,
        16,
        24,
    )
    assert target.geometry.moe is not None and target.geometry.moe.moe_layers == (1, 2, 3)
    draft = draft_config_for(target, 100)
    # MLA: one K/V head per query head, of the value width.
    assert (draft.num_attention_heads, draft.num_key_value_heads, draft.head_dim) == (4, 4, 12)


def test_kimi_k25_wrapper_reads_its_text_backbone() -> None:
    assert KIMI is not None
    g = geometry_of(KIMI)
    assert (g.architecture, g.wrapper, g.model_type) == (
        "KimiK25ForConditionalGeneration",
        "kimi_k25",
        "kimi_k2",
    )
    assert (g.num_layers, g.hidden_size, g.vocab_size, g.max_position_embeddings) == (
        61,
        7168,
        163840,
        262144,
    )
    att, moe = g.attention, g.moe
    assert (att.kind, att.num_heads, att.head_dim, att.v_head_dim) == ("mla", 64, 192, 128)
    assert (att.q_lora_rank, att.kv_lora_rank, att.qk_nope_head_dim, att.qk_rope_head_dim) == (
        1536,
        512,
        128,
        64,
    )
    assert moe is not None and (moe.num_experts, moe.active_experts, moe.shared_experts) == (384, 8, 1)
    assert moe.moe_layers == tuple(range(1, 61))  # one dense layer first
    assert g.rope.theta == 50000.0 and g.rope.scaling is not None
    assert g.rope.scaling["rope_type"] == "yarn" and g.rope.scaling["factor"] == 64.0
    # Moonshot's card: 1T total (with a ~0.4B vision tower left out here), 32B active.
    total, active = g.params()
    assert total == pytest.approx(1.04e12, rel=0.02) and active == pytest.approx(3.2e10, rel=0.04)
    shape = DraftShapeConfig(intermediate_size=12288).resolve(g)
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size) == (
        64,
        64,
        128,
        12288,
    )
    assert shape.rope == g.rope


def test_kimi_weight_bytes_agree_with_its_int4_experts() -> None:
    """The planner's one non-geometry fact, checked against the geometry: routed experts in int4 with a
    bf16 scale per 32 weights, everything else bf16."""
    assert KIMI is not None
    facts = target_facts(TargetConfig(name="moonshotai/Kimi-K2.5"))
    g = facts.geometry
    assert g.moe is not None
    experts = len(g.moe.moe_layers) * g.moe.num_experts * 3 * g.hidden_size * g.moe.expert_intermediate_size
    estimate = experts * (0.5 + 2 / 32) + (g.params()[0] - experts) * 2
    assert facts.weight_bytes == pytest.approx(estimate, rel=0.01)
    assert facts.active_params == g.params()[1]


def test_gpt_oss_moe_without_dense_layers(tmp_path) -> None:
    cfg = GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, **SMALL)  # fmt: skip
    g = geometry_of(saved(tmp_path, cfg))
    assert g.moe is not None and g.moe.moe_layers == (0, 1, 2, 3) and g.moe.expert_intermediate_size == 64
    assert g.rope.scaling is not None and g.rope.scaling["rope_type"] == "yarn"
    assert g.attention.kind == "gqa" and g.attention.head_dim == 16


def test_a_config_lacking_a_field_names_the_file_and_field() -> None:
    with pytest.raises(TargetError, match=r"where/config.json lacks hidden_size"):
        geometry_from_config({"num_hidden_layers": 2}, where="where/config.json")
    with pytest.raises(TargetError, match="lacks qk_nope_head_dim"):
        geometry_from_config(
            {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 8,
             "vocab_size": 10, "kv_lora_rank": 4},
        )  # fmt: skip


def test_draft_shape_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        DraftShapeConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="needs its rope_type"):
        DraftShapeConfig(rope_scaling={"factor": 2.0})
    assert KIMI is not None
    g = geometry_of(KIMI)
    with pytest.raises(ValueError, match="not a multiple"):
        DraftShapeConfig(num_kv_heads=48).resolve(g)
    plain = DraftShapeConfig(rope_theta=10000.0, rope_scaling="none").resolve(g)
    assert plain.rope.theta == 10000.0 and plain.rope.scaling is None
