"""Write a DFlash drafter as the directory SGLang loads with `--speculative-algorithm DFLASH
--speculative-draft-model-path DIR`, and read it back.

    DIR/config.json         DFlashDraftModel (model_type qwen3: the layers carry q/k norms), the target's
                            attention geometry, rope and context length, num_hidden_layers = the draft
                            layers, and dflash_config {block_size, target_layer_ids, mask_token_id,
                            num_target_layers} (block_size also top-level, where older loaders read it)
    DIR/model.safetensors   exactly `export_keys(cfg)` in bf16; no embedding and no lm_head (the target's)
    DIR/aerie.json          provenance SGLang ignores

`target_layer_ids` are in the output-of-layer convention (SGLang captures the input of layer id + 1);
`mask_token_id` is always written: SGLang otherwise looks a `<|MASK|>` token up in the tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from aerie.draft.dflash import DFlashConfig, DFlashDrafter
from aerie.draft.export import draft_config_for, layer_fields, load_exported, write_checkpoint
from aerie.draft.target_weights import load_embedding, load_lm_head
from aerie.targets import DrafterShape, TargetInfo

ARCHITECTURE = "DFlashDraftModel"

_LAYER_KEYS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def export_keys(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every exported tensor and its shape: the names SGLang's `DFlashDraftModel.load_weights` maps."""
    h, nh, nkv, hd, i = (
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
    )  # fmt: skip
    shapes = {
        "self_attn.q_proj.weight": (nh * hd, h),
        "self_attn.k_proj.weight": (nkv * hd, h),
        "self_attn.v_proj.weight": (nkv * hd, h),
        "self_attn.o_proj.weight": (h, nh * hd),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    out: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.num_context_features * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for layer in range(cfg.num_layers):
        out.update({f"layers.{layer}.{key}": shapes[key] for key in _LAYER_KEYS})
    return out


def dflash_config_for(
    target: TargetInfo,
    *,
    target_layer_ids: list[int],
    block_size: int,
    num_layers: int,
    mask_token_id: int | None,
    shape: DrafterShape | None = None,
) -> DFlashConfig:
    """The drafter geometry for a target: the draft layers' `shape` (None = the target's default), its
    vocabulary and hidden size (as EAGLE-3's `draft_config_for` derives them), and the block."""
    return DFlashConfig.of(
        draft_config_for(target, target.geometry.vocab_size, shape),
        mask_token_id=target.geometry.vocab_size - 1 if mask_token_id is None else mask_token_id,
        num_target_layers=target.geometry.num_layers,
        target_layer_ids=tuple(target_layer_ids),
        block_size=block_size,
        num_layers=num_layers,
    )


def hf_config(cfg: DFlashConfig, target: TargetInfo) -> dict[str, Any]:
    """config.json for SGLang's DFLASH worker (parsed by transformers as a Qwen3 config)."""
    rope_parameters: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling:
        rope_parameters.update(cfg.rope_scaling)
        rope_parameters["rope_type"] = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
    dflash = {
        "block_size": cfg.block_size,
        "target_layer_ids": list(cfg.target_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "num_target_layers": cfg.num_target_layers,
    }
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_layers,
        "hidden_act": "silu",
        "attention_bias": False,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": target.bos_token_id,
        "eos_token_id": target.eos_token_ids[0] if len(target.eos_token_ids) == 1 else target.eos_token_ids,
        "pad_token_id": target.pad_token_id,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": dflash,
    }


def export_state_dict(drafter: DFlashDrafter) -> dict[str, Tensor]:
    state = drafter.state_dict()
    return {
        key: state[key].detach().cpu().to(torch.bfloat16).contiguous() for key in export_keys(drafter.config)
    }


def export_dflash(
    drafter: DFlashDrafter, out_dir: str | Path, target: TargetInfo, provenance: dict[str, Any] | None = None
) -> Path:
    """Write config.json, model.safetensors and aerie.json into `out_dir`; returns it."""
    cfg = drafter.config
    meta = {
        "family": "dflash",
        "target_layers_output_convention": list(cfg.target_layer_ids),
        "draft_config": cfg.to_dict(),
        **(provenance or {}),
    }
    return write_checkpoint(out_dir, export_state_dict(drafter), hf_config(cfg, target), target, meta)


def config_from_hf(data: dict[str, Any]) -> DFlashConfig:
    """Read a DFlashConfig back from an exported config.json."""
    fields = layer_fields(data, ARCHITECTURE)
    dflash = data["dflash_config"]
    return DFlashConfig(
        **fields,
        mask_token_id=dflash["mask_token_id"],
        num_target_layers=dflash["num_target_layers"],
        target_layer_ids=tuple(dflash["target_layer_ids"]),
        block_size=dflash["block_size"],
        num_layers=data["num_hidden_layers"],
    )


def load_dflash(
    path: str | Path,
    target: TargetInfo,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> DFlashDrafter:
    """An exported drafter with the target's embedding and lm_head attached, in eval mode on `device`."""
    return load_exported(
        path,
        target,
        kind="a DFlash",
        parse=config_from_hf,
        build=lambda cfg: DFlashDrafter(cfg, load_embedding(target, dtype), load_lm_head(target, dtype)),
        keys=export_keys,
        device=device,
        dtype=dtype,
    )
