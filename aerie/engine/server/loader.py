"""Load the target model shard by shard, printing SGLang's load lines with real progress.

`from_pretrained` hides its shard loop, so the reference server builds the model on the meta device
(buffers such as RoPE frequencies stay real), then assigns each safetensors shard's tensors as it
reads them: the `Loading safetensors checkpoint shards` bar advances once per shard actually read.
An architecture whose checkpoint names differ from its module names (transformers renames some MoE
weights on load) leaves parameters unassigned; those fall back to `from_pretrained`, correct but with
a single progress step.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aerie.engine.server.sglang_log import avail_mem_gb, logger, shard_bar
from aerie.errors import TargetError
from aerie.targets import avoid_cudnn_attention

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class LoadedModel:
    """The model and the facts the server needs about it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    device: str
    dtype: torch.dtype
    num_layers: int
    hidden_size: int
    vocab_size: int
    context_len: int
    eos_token_ids: list[int]
    architecture: str
    model_type: str
    load_seconds: float
    timings: dict[str, float] = field(default_factory=dict)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise TargetError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def shard_files(model_path: Path) -> list[Path]:
    """The checkpoint's safetensors shards, in index order when there is an index."""
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_path / n for n in names]
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise TargetError(f"{model_path}: no *.safetensors checkpoint shards")
    return files


def load_model(
    model_path: str, device: str, dtype: str, *, skip_tokenizer: bool = False, trust_remote_code: bool = False
) -> LoadedModel:
    """Load weights (with SGLang's progress lines) and the tokenizer; raise TargetError on failure."""
    from transformers import AutoConfig

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    avoid_cudnn_attention(dev)
    path = Path(model_path).expanduser()
    before = avail_mem_gb(dev)
    logger.info(f"Load weight begin. avail mem={before:.2f} GB")
    start = time.perf_counter()
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = _load_sharded(path, config, dev, torch_dtype, trust_remote_code)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise TargetError(f"cannot load the model at {path}: {exc}") from exc
    model.eval()
    elapsed = time.perf_counter() - start
    after = avail_mem_gb(dev)
    text = getattr(config, "text_config", None) or config
    arch = (getattr(config, "architectures", None) or [type(model).__name__])[0]
    logger.info(
        f"Load weight end. elapsed={elapsed:.2f} s, type={arch}, dtype={torch_dtype}, "
        f"avail mem={after:.2f} GB, mem usage={max(before - after, 0.0):.2f} GB."
    )
    tokenizer = None if skip_tokenizer else _load_tokenizer(path, trust_remote_code)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=dev,
        dtype=torch_dtype,
        num_layers=int(text.num_hidden_layers),
        hidden_size=int(text.hidden_size),
        vocab_size=int(model.get_input_embeddings().weight.shape[0]),  # type: ignore[union-attr,index]
        context_len=int(getattr(text, "max_position_embeddings", 4096)),
        eos_token_ids=_eos_ids(path, config, tokenizer),
        architecture=arch,
        model_type=str(getattr(config, "model_type", "")),
        load_seconds=elapsed,
    )


def _load_sharded(path: Path, config: Any, device: str, dtype: torch.dtype, trust: bool) -> PreTrainedModel:
    from accelerate import init_empty_weights
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    files = shard_files(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attention_implementation(config), trust_remote_code=trust
        )
    _move_buffers(model, device)
    bar = shard_bar(len(files))
    with bar:
        for f in files:
            state = {
                k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(f, device=device).items()
            }
            model.load_state_dict(state, strict=False, assign=True)
            bar.update(1)
    model.tie_weights()
    unassigned = [n for n, p in model.named_parameters() if p.is_meta]
    if not unassigned:
        return model
    logger.info(
        f"{len(unassigned)} parameters are named differently in the checkpoint "
        f"(e.g. {unassigned[0]}); loading with from_pretrained instead."
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attention_implementation(config), trust_remote_code=trust
    )
    return model.to(device)  # type: ignore[arg-type]


def attention_implementation(config: Any) -> str:
    """SDPA where the architecture's transformers class supports it, else its eager attention (GPT-OSS:
    attention sinks, which SDPA has no input for). A class from the model's own code is asked the same."""
    from transformers import AutoModelForCausalLM
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    mapping = AutoModelForCausalLM._model_mapping  # type: ignore[attr-defined]
    auto_map = getattr(config, "auto_map", None) or {}
    cls: Any
    try:
        if type(config) in mapping:
            cls = mapping[type(config)]
        elif "AutoModelForCausalLM" in auto_map:
            cls = get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], config.name_or_path)
        else:
            return "sdpa"
    except (OSError, ValueError, KeyError):
        return "sdpa"  # from_config names what is wrong with the architecture
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def _move_buffers(model: torch.nn.Module, device: str) -> None:
    """Move the real buffers (RoPE frequencies) to the device; `Module.to` would fail on the meta parameters."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and not buf.is_meta:
                module._buffers[name] = buf.to(device)


def _load_tokenizer(path: Path, trust: bool) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    except (OSError, ValueError) as exc:
        raise TargetError(
            f"cannot load the tokenizer at {path}: {exc} (use --skip-tokenizer-init for ids only)"
        ) from exc


def _eos_ids(path: Path, config: Any, tokenizer: PreTrainedTokenizerBase | None) -> list[int]:
    """Every token that ends a generation: generation_config's eos ids, the config's, the tokenizer's."""
    ids: list[int] = []
    gen = path / "generation_config.json"
    sources: list[Any] = [json.loads(gen.read_text()).get("eos_token_id")] if gen.is_file() else []
    sources.append(getattr(config, "eos_token_id", None))
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for src in sources:
        for i in [src] if isinstance(src, int) else list(src or []):
            if int(i) not in ids:
                ids.append(int(i))
    return ids
