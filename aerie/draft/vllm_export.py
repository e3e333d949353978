"""The drafter as vLLM loads it: the `speculators` format, in a `vllm/` folder beside SGLang's layout.

    DIR/vllm/config.json         speculators_model_type eagle3: the decoder layer as transformer_layer_config,
                                 draft_vocab_size, target_hidden_size, norm_before_residual false, the
                                 capture layers in vLLM's convention, and the verifier (the target)
    DIR/vllm/model.safetensors   the same tensors as DIR/model.safetensors, the layer named layers.0.*

vLLM serves it as the speculative model of the target:

    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "DIR/vllm", "num_speculative_tokens": K}'

Why a folder of its own, not SGLang's config.json read by vLLM: the two servers count the capture layers
differently. SGLang's `eagle_aux_hidden_state_layer_ids` name the layers whose *output* is captured and it
adds one; vLLM's name the residual stream *entering* a layer and it adds nothing, so SGLang's file read by
vLLM would feed the drafter the states one layer too early. And vLLM's speculators reader takes a missing
`norm_before_residual` as true, where aerie's layer adds the un-normed hidden state to the residual.
The weights are a copy under speculators' names (layers.0.* for SGLang's midlayer.*), so the folder is a
complete checkpoint on its own: copied, uploaded or published without the SGLang files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch stays out of the config's imports (the deploy config names the launch line)
    from torch import Tensor

    from aerie.targets import TargetInfo

FOLDER = "vllm"
# The file names of a Hugging Face checkpoint, which both layouts are.
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
METHOD = "eagle3"
ARCHITECTURE = "Eagle3Speculator"
# The `speculators` release whose config schema this file follows (speculators' Eagle3SpeculatorConfig).
SPECULATORS_VERSION = "0.9.0"
SGLANG_LAYER = "midlayer."
LAYER = "layers.0."
# SGLang's config fields that are no part of the decoder layer's own config.
_NOT_LAYER_FIELDS = {"architectures", "draft_vocab_size", "eagle_config"}


def speculator_tensors(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """SGLang's exported tensors under speculators' names: midlayer.* becomes layers.0.*."""
    return {_speculators_name(key): tensor for key, tensor in state.items()}


def _speculators_name(key: str) -> str:
    return LAYER + key.removeprefix(SGLANG_LAYER) if key.startswith(SGLANG_LAYER) else key


def speculators_config(
    sglang_config: dict[str, Any], target: TargetInfo, speculative_tokens: int
) -> dict[str, Any]:
    """config.json of the speculators format for the drafter SGLang's `sglang_config` describes."""
    layer = {k: v for k, v in sglang_config.items() if k not in _NOT_LAYER_FIELDS}
    sglang_aux = sglang_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": METHOD,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": sglang_config["draft_vocab_size"],
        "target_hidden_size": target.geometry.hidden_size,
        # aerie's layer keeps the un-normed hidden state as the residual; vLLM's default is the opposite.
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        # vLLM captures the residual stream entering these target layers: SGLang's output-of-layer ids + 1.
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in sglang_aux],
        "torch_dtype": sglang_config.get("torch_dtype", "bfloat16"),
        "speculators_config": {
            "algorithm": METHOD,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target.path, "architectures": [target.geometry.architecture]},
        },
    }


def write_vllm_folder(
    drafter_dir: str | Path,
    target: TargetInfo,
    state: dict[str, Tensor],
    sglang_config: dict[str, Any],
    speculative_tokens: int = 3,
) -> Path:
    """Write DIR/vllm/ from the SGLang layout's tensors `state` and config.json `sglang_config`; returns
    the folder. `speculative_tokens` is only the default a launch without num_speculative_tokens takes."""
    from safetensors.torch import save_file

    out = Path(drafter_dir) / FOLDER
    out.mkdir(parents=True, exist_ok=True)
    save_file(speculator_tensors(state), str(out / WEIGHTS), metadata={"format": "pt"})
    config = speculators_config(sglang_config, target, speculative_tokens)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out


def vllm_serve_argv(target_path: str, drafter_dir: str | Path, num_steps: int) -> list[str]:
    """`vllm serve` with the drafter of `drafter_dir` (its vllm/ folder) drafting `num_steps` tokens."""
    spec = {"method": METHOD, "model": str(Path(drafter_dir) / FOLDER), "num_speculative_tokens": num_steps}
    return ["vllm", "serve", target_path, "--speculative-config", json.dumps(spec)]
