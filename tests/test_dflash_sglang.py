"""The DFlash drafter as SGLang 0.5.23 loads it: SGLang's own `DFlashDraftModel`, built in process in
SGLang's environment by its model loader from aerie's exported directory (the embedded target's geometry,
DFlash's five target layers, two draft layers, random weights), gets `load_weights` on the exported
files. SGLang skips a name it does not know without a word, so every parameter starts as NaN and is
compared with the file's tensors afterwards; a drafter with one tensor renamed shows the comparison
catches a skipped one. Serving DFlash is GPU-only in SGLang (its attention backends); this is the load."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aerie.draft.dflash_export import export_dflash
from aerie.draft.export import WEIGHTS
from aerie.targets import TargetInfo
from aerie.train.config import TrainConfig
from aerie.train.dflash_objective import DFlashObjective
from tests.sglang_support import script_env, sglang_python, shim_calls

pytestmark = pytest.mark.sglang

LOADER = Path(__file__).with_name("dflash_sglang_load.py")
# SGLang fuses q, k, v and gate, up into one parameter each on load.
FUSED = {"self_attn.qkv_proj.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
         "mlp.gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"]}  # fmt: skip
RENAMED = ("layers.1.mlp.up_proj.weight", "layers.1.mlp.up.weight")


def file_tensors(param: str) -> list[str]:
    """The exported tensors SGLang's parameter `param` is made of (by aerie's export names)."""
    head, _, rest = param.partition(".")
    if head == "layers":
        index, _, leaf = rest.partition(".")
        return [f"layers.{index}.{name}" for name in FUSED.get(leaf, [leaf])]
    return [param]


def not_from_file(loaded: dict[str, torch.Tensor], exported: dict[str, torch.Tensor]) -> list[str]:
    """SGLang's parameters whose values are not exactly the file's."""
    wrong = []
    for param, value in loaded.items():
        names = file_tensors(param)
        present = all(n in exported for n in names)
        if not present or not torch.equal(value, torch.cat([exported[n] for n in names]).to(value.dtype)):
            wrong.append(param)
    return wrong


def exported(target: TargetInfo, out: Path) -> Path:
    objective = DFlashObjective(TrainConfig(drafter={"family": "dflash", "num_layers": 2}))
    torch.manual_seed(0)
    drafter = objective.drafter(target, target.geometry.vocab_size)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.1)
    return export_dflash(drafter, out, target)


def test_sglang_loads_every_tensor_of_the_dflash_export(smollm2, tmp_path) -> None:
    python = sglang_python()
    good = exported(smollm2, tmp_path / "dflash")
    renamed = tmp_path / "renamed"
    shutil.copytree(good, renamed)
    tensors = load_file(str(good / WEIGHTS))
    tensors[RENAMED[1]] = tensors.pop(RENAMED[0])
    save_file(tensors, str(renamed / WEIGHTS))
    out = tmp_path / "loaded"
    out.mkdir()
    calls = tmp_path / "shim-calls"
    env = script_env(calls, {"SGLANG_USE_CPU_ENGINE": "1"})
    proc = subprocess.run(
        [python, str(LOADER), str(out), str(good), str(renamed)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert shim_calls(calls) == []  # no stand-in for a compiled kernel was called
    first, second = json.loads((out / "result.json").read_text())
    assert first == {
        "class": "DFlashDraftModel",
        "dtype": "torch.bfloat16",
        "block_size": 8,
        "target_layer_ids": [1, 8, 14, 21, 27],  # what aerie captured, in SGLang's reading of the config
        "mask_token_id": smollm2.geometry.vocab_size - 1,
        "num_context_features": 5,
        "num_layers": 2,
    }
    want = load_file(str(good / WEIGHTS))
    loaded = load_file(str(out / "0.safetensors"))
    # fc, hidden_norm, norm; per layer qkv, o, q/k norms, two layernorms, gate_up, down: 11 tensors fused to 8.
    assert len(loaded) == 3 + 2 * 8
    assert not_from_file(loaded, want) == []
    # A tensor SGLang does not know is skipped silently: its parameter keeps the NaN it started with.
    skipped = load_file(str(out / "1.safetensors"))
    assert not_from_file(skipped, want) == ["layers.1.mlp.gate_up_proj.weight"]
    assert second == first
