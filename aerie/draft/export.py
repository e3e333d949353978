"""Write a drafter as the directory SGLang loads with `--speculative-algorithm EAGLE3
--speculative-draft-model-path DIR`, and read it back.

    DIR/config.json         LlamaForCausalLMEagle3, the target's attention geometry, rope and context length,
                            draft_vocab_size, eagle_config with the capture layers (output-of-layer convention)
    DIR/model.safetensors   exactly EXPORT_KEYS (bf16 weights, d2t int64, t2d bool); no embedding
    DIR/aerie.json          provenance SGLang ignores: target, revision, layer conventions, vocab coverage
    DIR/vllm/               the same drafter in the layout vLLM loads (aerie.draft.vllm_export)

Two fields decide whether a drafter works at all in SGLang, so they are never defaulted:
`tie_word_embeddings` must be false (true makes SGLang use the *embedding* as the draft lm_head), and
`max_position_embeddings` is the target's (2048 silently crippled peers' drafters on longer contexts).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from aerie.draft.model import DraftConfig, Eagle3Drafter
from aerie.draft.target_weights import load_embedding
from aerie.draft.vllm_export import write_vllm_folder
from aerie.errors import TargetError
from aerie.targets import DrafterShape, TargetInfo

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
PROVENANCE = "aerie.json"
ARCHITECTURE = "LlamaForCausalLMEagle3"

C = TypeVar("C")
M = TypeVar("M", bound=torch.nn.Module)

# key -> shape as a function of the config; the exact contract SGLang's load_weights consumes.
EXPORT_KEYS: dict[str, Any] = {
    "fc.weight": lambda c: (c.hidden_size, 3 * c.hidden_size),
    "midlayer.self_attn.q_proj.weight": lambda c: (c.num_attention_heads * c.head_dim, 2 * c.hidden_size),
    "midlayer.self_attn.k_proj.weight": lambda c: (c.num_key_value_heads * c.head_dim, 2 * c.hidden_size),
    "midlayer.self_attn.v_proj.weight": lambda c: (c.num_key_value_heads * c.head_dim, 2 * c.hidden_size),
    "midlayer.self_attn.o_proj.weight": lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim),
    "midlayer.mlp.gate_proj.weight": lambda c: (c.intermediate_size, c.hidden_size),
    "midlayer.mlp.up_proj.weight": lambda c: (c.intermediate_size, c.hidden_size),
    "midlayer.mlp.down_proj.weight": lambda c: (c.hidden_size, c.intermediate_size),
    "midlayer.input_layernorm.weight": lambda c: (c.hidden_size,),
    "midlayer.hidden_norm.weight": lambda c: (c.hidden_size,),
    "midlayer.post_attention_layernorm.weight": lambda c: (c.hidden_size,),
    "norm.weight": lambda c: (c.hidden_size,),
    "lm_head.weight": lambda c: (c.draft_vocab_size, c.hidden_size),
    "d2t": lambda c: (c.draft_vocab_size,),
    "t2d": lambda c: (c.vocab_size,),
}


def draft_config_for(
    target: TargetInfo, draft_vocab_size: int, shape: DrafterShape | None = None
) -> DraftConfig:
    """The drafter for a target: one Llama layer of `shape` (None = the target's default,
    `TargetGeometry.default_drafter`) on the target's hidden size, vocab, norm eps and context length.
    SGLang reads every field of the shape from the drafter's own config.json."""
    shape = shape or target.geometry.default_drafter()
    return DraftConfig(
        hidden_size=target.geometry.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        vocab_size=target.geometry.vocab_size,
        draft_vocab_size=min(draft_vocab_size, target.geometry.vocab_size),
        rms_norm_eps=target.geometry.rms_norm_eps,
        rope_theta=shape.rope.theta,
        rope_scaling=shape.rope.scaling,
        max_position_embeddings=target.geometry.max_position_embeddings,
        aux_layer_ids=tuple(target.aux_layers_output),
    )


def hf_config(cfg: DraftConfig, target: TargetInfo) -> dict[str, Any]:
    """config.json for SGLang (and transformers' LlamaConfig, which it is parsed with)."""
    rope_parameters: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling:
        rope_parameters.update(cfg.rope_scaling)
        rope_parameters["rope_type"] = cfg.rope_scaling.get("rope_type", cfg.rope_scaling.get("type"))
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        # Older SGLang/transformers read rope_theta + rope_scaling; transformers >= 5 reads rope_parameters.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": target.bos_token_id,
        "eos_token_id": target.eos_token_ids[0] if len(target.eos_token_ids) == 1 else target.eos_token_ids,
        "pad_token_id": target.pad_token_id,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
    }


def export_state_dict(drafter: Eagle3Drafter) -> dict[str, Tensor]:
    """The exported tensors: weights in bf16, d2t int64, t2d bool, contiguous and on the CPU."""
    state = drafter.state_dict()
    out: dict[str, Tensor] = {}
    for key in EXPORT_KEYS:
        tensor = state[key].detach().cpu()
        if key == "d2t":
            out[key] = tensor.to(torch.int64).contiguous()
        elif key == "t2d":
            out[key] = tensor.to(torch.bool).contiguous()
        else:
            out[key] = tensor.to(torch.bfloat16).contiguous()
    return out


def write_checkpoint(
    out_dir: str | Path,
    state: dict[str, Tensor],
    config: dict[str, Any],
    target: TargetInfo,
    meta: dict[str, Any],
) -> Path:
    """The layout every family's export has: `model.safetensors` (`state`), `config.json` (what the
    server reads) and `aerie.json` (the target it was trained for, then `meta`); returns `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    meta = {"target": target.name, "target_revision": target.revision, **meta}
    (out / PROVENANCE).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return out


def export_drafter(
    drafter: Eagle3Drafter, out_dir: str | Path, target: TargetInfo, provenance: dict[str, Any] | None = None
) -> Path:
    """Write config.json, model.safetensors and aerie.json into `out_dir`; returns it."""
    cfg = drafter.config
    meta = {
        "aux_layers_output_convention": list(cfg.aux_layer_ids),
        "aux_layers_input_convention": [i + 1 for i in cfg.aux_layer_ids],
        "draft_config": cfg.to_dict(),
        **(provenance or {}),
    }
    state, config = export_state_dict(drafter), hf_config(cfg, target)
    write_vllm_folder(out_dir, target, state, config)
    return write_checkpoint(out_dir, state, config, target, meta)


def config_from_hf(data: dict[str, Any]) -> DraftConfig:
    """Read a DraftConfig back from an exported config.json."""
    return DraftConfig(
        **layer_fields(data, ARCHITECTURE),
        draft_vocab_size=data["draft_vocab_size"],
        aux_layer_ids=tuple(data["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
    )


def layer_fields(data: dict[str, Any], architecture: str) -> dict[str, Any]:
    """What every family's exported config.json says of its decoder layer (widths, heads, norm, RoPE),
    read back as its config's fields; a `TargetError` where the file is another architecture's."""
    if architecture not in data.get("architectures", []):
        raise TargetError(f"config.json architectures {data.get('architectures')} lack {architecture}")
    return {
        "hidden_size": data["hidden_size"],
        "intermediate_size": data["intermediate_size"],
        "num_attention_heads": data["num_attention_heads"],
        "num_key_value_heads": data["num_key_value_heads"],
        "head_dim": data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"],
        "vocab_size": data["vocab_size"],
        "rms_norm_eps": data["rms_norm_eps"],
        "rope_theta": data.get("rope_theta", 10000.0),
        "rope_scaling": data.get("rope_scaling"),
        "max_position_embeddings": data["max_position_embeddings"],
    }


def load_drafter(
    path: str | Path,
    target: TargetInfo,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> Eagle3Drafter:
    """An exported drafter with the target's embedding attached, in eval mode on `device`."""
    return load_exported(
        path,
        target,
        kind="an EAGLE-3",
        parse=config_from_hf,
        build=lambda cfg: Eagle3Drafter(cfg, load_embedding(target, dtype)),
        keys=lambda cfg: EXPORT_KEYS,
        device=device,
        dtype=dtype,
    )


def load_exported(
    path: str | Path,
    target: TargetInfo,
    *,
    kind: str,
    parse: Callable[[dict[str, Any]], C],
    build: Callable[[C], M],
    keys: Callable[[C], Iterable[str]],
    device: str | torch.device,
    dtype: torch.dtype,
) -> M:
    """Any family's exported directory read back: `parse` its config.json (`TargetError` naming the
    file when it is not `kind`'s), check it was made for `target`, `build` the module, and load exactly
    its weights (every one of `keys(cfg)` present, nothing else), in eval mode on `device`."""
    root = Path(path)
    try:
        cfg = parse(json.loads((root / CONFIG).read_text()))
    except (OSError, ValueError, KeyError) as exc:
        raise TargetError(f"{root / CONFIG} is not {kind} drafter config: {exc!r}") from exc
    hidden, vocab = getattr(cfg, "hidden_size"), getattr(cfg, "vocab_size")  # noqa: B009 - any family's config
    if (hidden, vocab) != (target.geometry.hidden_size, target.geometry.vocab_size):
        raise TargetError(
            f"drafter at {root} is for hidden {hidden} / vocab {vocab}, "
            f"target {target.name} has {target.geometry.hidden_size} / {target.geometry.vocab_size}"
        )
    drafter = build(cfg)
    with safe_open(str(root / WEIGHTS), "pt") as f:
        state = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    missing = set(keys(cfg)) - set(state)
    if missing:
        raise TargetError(f"{root / WEIGHTS} lacks {sorted(missing)}")
    drafter.load_state_dict(state, strict=True)
    return drafter.to(device=device, dtype=dtype).eval()
