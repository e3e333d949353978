"""Run by SGLang's own interpreter (not aerie's): build SGLang's EAGLE-3 draft model in process and load
exported drafter directories into it the way its draft worker does, then report what was written.

    python sglang_drafter_load.py REQUEST.json OUT_DIR

REQUEST.json: {"argv": the speculative server's arguments (as `sglang.launch_server` receives them),
"drafters": [dir, ...]}. Each drafter is built by SGLang's `_initialize_model` from
`ModelConfig.from_server_args(..., is_draft_model=True)` under one process group (gloo, world size 1)
with the server arguments published, every parameter filled with NaN first; then `load_weights` gets the
directory's tensors through SGLang's own safetensors iterator. OUT_DIR gets, for drafter i,
`i.safetensors` (every parameter as loaded) and in `result.json`: the class SGLang picked, its dtype,
`hot_token_id`, hidden size and vocab sizes from its config, and the layers the target captures: the
target's own SGLang class (built on the meta device) given the layer ids SGLang reads from the draft
config.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def publish_args(argv: list[str]) -> Any:
    """Server arguments resolved and published as SGLang's scheduler does (re-publishing is SGLang's
    last-publish-wins: one process may load the drafters of several targets in turn)."""
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    return server_args


def start(argv: list[str]) -> Any:
    """Server arguments resolved and published, and the process group SGLang's scheduler would build."""
    from sglang.srt.distributed.bootstrap import init_parallel_runtime

    server_args = publish_args(argv)
    init_parallel_runtime(server_args=server_args, device="cpu", dist_port=_free_port())
    return server_args


def target_model(target: Any) -> Any:
    """The target's own SGLang class (the one its registry maps the config's architecture to), built on
    the meta device: no memory and no weights, only what its capture hooks need."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    with set_default_torch_dtype(target.dtype), torch.device("meta"):
        return _initialize_model(target, LoadConfig())


def capture_layers(
    model: Any, layer_ids: list[int] | None, hook: str = "set_eagle3_layers_to_capture"
) -> list[int]:
    """The layers whose input the target model captures for these draft layer ids, by its own hook (a
    multimodal wrapper hands it to its language model)."""
    getattr(model, hook)(layer_ids)
    inner = getattr(model, "language_model", None) or model
    return list(inner.model.layers_to_capture)


def build_and_load(server_args: Any, drafter: str, out: Path) -> tuple[Any, Any]:
    """(config, model): the draft model class SGLang's registry maps `drafter` to, built by SGLang's own
    `_initialize_model`, every parameter NaN, then the directory's tensors through `load_weights`; every
    parameter as loaded is saved to `out`."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    config = ModelConfig.from_server_args(server_args, model_path=drafter, is_draft_model=True)
    with set_default_torch_dtype(config.dtype), torch.device("cpu"):
        model = _initialize_model(config, LoadConfig())
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    files = sorted(str(p) for p in Path(drafter).glob("*.safetensors"))
    model.load_weights(safetensors_weights_iterator(files))
    save_file({name: p.detach().contiguous() for name, p in model.named_parameters()}, str(out))
    return config, model


def load(server_args: Any, drafter: str, out: Path) -> dict[str, Any]:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    config, model = build_and_load(server_args, drafter, out)
    target = ModelConfig.from_server_args(server_args)
    aux = resolve_spec_aux_hidden_state_config(
        server_args=server_args,
        model_config=target,
        spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE3"),
        is_draft_worker=False,
    )
    hot = model.get_hot_token_id()
    return {
        "class": type(model).__name__,
        "dtype": str(config.dtype),
        "hot_token_id": None if hot is None else hot.tolist(),
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": getattr(config.hf_config, "draft_vocab_size", None),
        "lm_head_rows": int(model.lm_head.weight.shape[0]),
        "aux_layer_ids": aux.eagle_aux_hidden_state_layer_ids,
        "target_capture_layers": capture_layers(target_model(target), aux.eagle_aux_hidden_state_layer_ids),
    }


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    server_args = start(request["argv"])
    result = [load(server_args, d, out / f"{i}.safetensors") for i, d in enumerate(request["drafters"])]
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
