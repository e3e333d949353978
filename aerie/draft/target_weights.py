"""Read the two target tensors a drafter needs — the token embedding and the lm_head — without loading
the target model (Kimi-K2.5 is a terabyte; these two are 2.3 GB each).

Both are found by name suffix in the target's safetensors files (through `model.safetensors.index.json`
when sharded), so wrappers such as `language_model.model.embed_tokens.weight` work. A target with tied
embeddings has no lm_head tensor: its embedding is the head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from aerie.errors import TargetError
from aerie.targets import TargetInfo

EMBED_SUFFIX = "embed_tokens.weight"
HEAD_SUFFIX = "lm_head.weight"


def _tensor_files(root: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise TargetError(f"{root} holds no *.safetensors files")
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            names.update({name: file for name in f.keys()})  # noqa: SIM118 - safe_open has no __iter__
    return names


def _find(target: TargetInfo, suffix: str) -> Tensor | None:
    """The [V, H] tensor whose name ends in `suffix`, or None when the checkpoint has none."""
    root = Path(target.path)
    for name, file in sorted(_tensor_files(root).items()):
        if not name.endswith(suffix):
            continue
        with safe_open(str(file), "pt") as f:
            if tuple(f.get_slice(name).get_shape()) != (
                target.geometry.vocab_size,
                target.geometry.hidden_size,
            ):
                continue  # e.g. a vision tower's embedding in a multimodal wrapper
            return f.get_tensor(name)
    return None


def load_embedding(target: TargetInfo, dtype: torch.dtype = torch.float32) -> Tensor:
    """The target's token embedding [V, H]."""
    weight = _find(target, EMBED_SUFFIX)
    if weight is None:
        raise TargetError(
            f"no [{target.geometry.vocab_size}, {target.geometry.hidden_size}] tensor named *{EMBED_SUFFIX} in {target.path}"
        )
    return weight.to(dtype)


def load_lm_head(target: TargetInfo, dtype: torch.dtype = torch.float32) -> Tensor:
    """The target's lm_head [V, H] (its embedding when the embeddings are tied)."""
    weight = _find(target, HEAD_SUFFIX)
    if weight is None:
        if not target.geometry.tie_word_embeddings:
            raise TargetError(f"{target.path} has no *{HEAD_SUFFIX} and does not tie its embeddings")
        return load_embedding(target, dtype)
    return weight.to(dtype)


def load_final_norm(target: TargetInfo) -> Tensor | None:
    """The target's final RMSNorm weight [H] (`model.norm.weight`), or None when it cannot be told apart."""
    root = Path(target.path)
    for name, file in sorted(_tensor_files(root).items()):
        if name.endswith("model.norm.weight"):
            with safe_open(str(file), "pt") as f:
                if tuple(f.get_slice(name).get_shape()) == (target.geometry.hidden_size,):
                    return f.get_tensor(name).float()
    return None
