"""Run by SGLang's own interpreter (not aerie's): for each tiny target of a request, its exported EAGLE-3
and DFlash drafters loaded into SGLang's own classes the way `sglang_drafter_load.py` and
`dflash_sglang_load.py` load one, under that target's server arguments, and the layers the target's own
SGLang class captures for each drafter.

    python architectures_sglang_load.py REQUEST.json OUT_DIR

REQUEST.json: {"targets": [{"name": ..., "argv": the speculative server's arguments for the target,
"eagle3": dir, "dflash": dir}, ...]}. OUT_DIR/NAME/{eagle3,dflash}.safetensors hold every parameter as
loaded; OUT_DIR/result.json maps each name to {"eagle3": ..., "dflash": ...}, the loaders' reports, the
DFlash one with the target class's capture layers added. aerie must be importable (PYTHONPATH).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflash_sglang_load import load as load_dflash
from sglang_drafter_load import capture_layers, publish_args, start, target_model
from sglang_drafter_load import load as load_eagle3


def main() -> None:
    from sglang.srt.configs.model_config import ModelConfig

    from aerie.sglang_plugin.compat import default_config_fields

    # A DeepSeek-V3 config.json written by transformers lacks `moe_layer_freq`, which SGLang's DeepSeek
    # class reads; aerie's extraction plugin gives the config class its default, and so does this load.
    default_config_fields()

    request = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    result = {}
    for i, job in enumerate(request["targets"]):
        # One process group for the process; each target's arguments published in turn.
        server_args = start(job["argv"]) if i == 0 else publish_args(job["argv"])
        where = out / job["name"]
        where.mkdir(parents=True, exist_ok=True)
        eagle3 = load_eagle3(server_args, job["eagle3"], where / "eagle3.safetensors")
        dflash = load_dflash(server_args, job["dflash"], where / "dflash.safetensors")
        target = target_model(ModelConfig.from_server_args(server_args))
        dflash["target_capture_layers"] = capture_layers(
            target, dflash["target_layer_ids"], "set_dflash_layers_to_capture"
        )
        result[job["name"]] = {"eagle3": eagle3, "dflash": dflash}
        print(job["name"], "loaded", flush=True)
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
