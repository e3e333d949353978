"""Run by SGLang's own interpreter (not aerie's): build SGLang's EAGLE-3 draft model for a drafter
config.json on torch's meta device (real sizes, no memory, no weights) the way its draft worker builds
it, and the target's own SGLang class the same way, then report the shapes.

    python sglang_drafter_meta.py REQUEST.json OUT.json

REQUEST.json: {"argv": the speculative server's arguments, "drafter": a directory holding config.json}.
OUT.json: the class SGLang picked, every parameter's name and shape, the draft vocab SGLang read, its
rotary embedding (class, base, width, scaling factor), the layer ids it reads from the draft config,
and the layers the target's own class then captures. aerie
must be importable (PYTHONPATH): SGLang gets the DeepSeek config defaults aerie's plugin gives it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from sglang_drafter_load import capture_layers, start, target_model


def drafter_on_meta(server_args: Any, drafter: str) -> tuple[Any, Any]:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    config = ModelConfig.from_server_args(server_args, model_path=drafter, is_draft_model=True)
    with set_default_torch_dtype(config.dtype), torch.device("meta"):
        return config, _initialize_model(config, LoadConfig())


def main() -> None:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from aerie.sglang_plugin.compat import default_config_fields

    default_config_fields()
    request = json.loads(Path(sys.argv[1]).read_text())
    server_args = start(request["argv"])
    config, model = drafter_on_meta(server_args, request["drafter"])
    target = ModelConfig.from_server_args(server_args)
    aux = resolve_spec_aux_hidden_state_config(
        server_args=server_args,
        model_config=target,
        spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE3"),
        is_draft_worker=False,
    )
    layer_ids = aux.eagle_aux_hidden_state_layer_ids
    result = {
        "class": type(model).__name__,
        "device": str(next(model.parameters()).device),
        "params": {name: list(p.shape) for name, p in model.named_parameters()},
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": getattr(config.hf_config, "draft_vocab_size", None),
        "target_class": None,
        "aux_layer_ids": layer_ids,
        "target_capture_layers": None,
    }
    rope = model.model.layers[0].self_attn.rotary_emb
    result["rope"] = {
        "class": type(rope).__name__,
        "base": float(rope.base),
        "rotary_dim": int(rope.rotary_dim),
        "scaling_factor": getattr(rope, "scaling_factor", None),
    }
    built = target_model(target)
    result["target_class"] = type(built).__name__
    result["target_capture_layers"] = capture_layers(built, layer_ids)
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
