"""Run by SGLang's own interpreter (not aerie's): build SGLang's DFlash draft model in process from an
exported drafter directory, the way its DFLASH worker does, load the directory's weights into it, and
report what was written.

    python dflash_sglang_load.py OUT_DIR DRAFTER_DIR [DRAFTER_DIR ...]

The model class is the one SGLang's model registry maps the directory's `architectures` to, built by
SGLang's `_initialize_model` from `ModelConfig(DRAFTER_DIR, is_draft_model=True)` under one process group
(gloo, world size 1, as `sglang_drafter_load.start` sets it up); every parameter is filled with NaN first, then `load_weights` gets the directory's
tensors through SGLang's own safetensors iterator. OUT_DIR gets, for drafter i, `i.safetensors` (every
parameter as loaded) and in `result.json`: the class, the block size, target layer ids, mask token id,
context feature count and draft layer count SGLang derived from the config.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# The EAGLE-3 loader beside this file: the same server arguments, process group and weight loading.
from sglang_drafter_load import build_and_load, start


def load(server_args: Any, drafter: str, out: Path) -> dict[str, Any]:
    config, model = build_and_load(server_args, drafter, out)
    draft = model.draft_config
    layer_ids = draft.resolve_target_layer_ids(
        target_num_layers=int(draft.num_target_layers), draft_num_layers=len(model.layers)
    )
    return {
        "class": type(model).__name__,
        "dtype": str(config.dtype),
        "block_size": int(model.block_size),
        "target_layer_ids": list(layer_ids),
        "mask_token_id": draft.mask_token_id,
        "num_context_features": int(model.num_context_features),
        "num_layers": len(model.layers),
    }


def main() -> None:
    out, drafters = Path(sys.argv[1]), sys.argv[2:]
    server_args = start(["--model-path", drafters[0], "--device", "cpu", "--skip-server-warmup"])
    result = [load(server_args, d, out / f"{i}.safetensors") for i, d in enumerate(drafters)]
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
