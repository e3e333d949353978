"""The drafter as SGLang loads it: SGLang's own `LlamaForCausalLMEagle3`, built in process in SGLang's
environment from aerie's exported config (the embedded default's drafter geometry and draft vocab, random
weights, a vocab map from skewed token counts), gets `load_weights` on the exported files. SGLang skips
a name it does not know without a word, so every parameter starts as NaN and is compared with the file's
tensors afterwards; a drafter with one tensor renamed shows the comparison catches a skipped one.

Served EAGLE-3 speculation is GPU-only in SGLang 0.5.23, so no test serves the drafter here: on the CPU
engine the KV pool calls sgl_kernel's copy_all_layer_kv_cache_cpu (a compiled op with no CPU build on
PyPI), and past it SGLang refuses 'EAGLE is not supported in decode attention backend torch_native'
(srt/speculative/draft_utils.py); its one CPU EAGLE backend, intel_amx, needs AMX, which this CPU lacks.
The GPU-host jobs serve it (benchmarks/gpu: sgl-serve)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from aerie.deploy.work import server_specs
from aerie.draft.export import WEIGHTS, draft_config_for, export_drafter
from aerie.draft.model import Eagle3Drafter
from aerie.draft.target_weights import load_embedding
from aerie.draft.vocab import VocabMap, build_vocab_map
from aerie.presets import load_config
from aerie.targets import TargetInfo
from tests.sglang_support import script_env, sglang_argv, sglang_python, shim_calls

pytestmark = pytest.mark.sglang

LOADER = Path(__file__).with_name("sglang_drafter_load.py")

# SGLang's parameter -> the exported tensors it is made of (q, k, v and gate, up are fused on load).
LAYER = "model.layers.0"
FUSED = {
    f"{LAYER}.self_attn.qkv_proj.weight": [f"midlayer.self_attn.{x}_proj.weight" for x in "qkv"],
    f"{LAYER}.mlp.gate_up_proj.weight": ["midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"],
}
# The draft layers run on the target's token embedding: SGLang's draft worker hands the target's to the
# drafter at serve time, so aerie exports none and the drafter's own stays as built.
SHARED_WITH_TARGET = "model.embed_tokens.weight"
RENAMED = ("midlayer.mlp.gate_proj.weight", "midlayer.mlp.gate.weight")


def file_tensors(param: str) -> list[str]:
    """The exported tensors SGLang's parameter `param` should hold (by aerie's export names)."""
    if param in FUSED:
        return FUSED[param]
    name = param.removeprefix("model.").replace("layers.0.", "midlayer.")
    return [name]


def not_from_file(loaded: dict[str, torch.Tensor], exported: dict[str, torch.Tensor]) -> list[str]:
    """SGLang's parameters whose values are not exactly the file's (cast to the parameter's dtype)."""
    wrong = []
    for param, value in loaded.items():
        if param == SHARED_WITH_TARGET:
            continue
        names = file_tensors(param)
        if not all(n in exported for n in names):
            wrong.append(param)
            continue
        expected = torch.cat([exported[n] for n in names]).to(value.dtype)
        if not torch.equal(value, expected):
            wrong.append(param)
    return wrong


def vocab_map(target: TargetInfo, size: int) -> VocabMap:
    """A draft vocab chosen from skewed counts, so d2t is far from the identity."""
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 1000, (target.geometry.vocab_size,), generator=g) * (
        torch.rand(target.geometry.vocab_size, generator=g) < 0.2
    )
    return build_vocab_map(counts, size)


def exported_drafter(target: TargetInfo, out: Path) -> tuple[Path, VocabMap]:
    train = load_config("smollm2-local", []).train
    vocab = vocab_map(target, train.drafter.draft_vocab_size)
    cfg = draft_config_for(target, vocab.draft_vocab_size, train.draft.resolve(target.geometry))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, load_embedding(target)).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.05)
    drafter.set_vocab(vocab.d2t, vocab.t2d)
    return export_drafter(drafter, out, target), vocab


def with_renamed_tensor(src: Path, out: Path) -> Path:
    shutil.copytree(src, out)
    tensors = load_file(str(src / WEIGHTS))
    tensors[RENAMED[1]] = tensors.pop(RENAMED[0])
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, smollm2) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("sglang-drafter")
    drafter, vocab = exported_drafter(smollm2, tmp / "drafter")
    broken = with_renamed_tensor(drafter, tmp / "renamed")
    cfg = load_config("smollm2-local", ["server.backend=sglang"])
    spec = server_specs(cfg.deploy, cfg.server, smollm2, str(drafter))["speculative"]
    out = tmp / "out"
    out.mkdir()
    (tmp / "request.json").write_text(
        json.dumps({"argv": sglang_argv(spec), "drafters": [str(drafter), str(broken)]})
    )
    calls = tmp / "shim-calls"
    run = subprocess.run(
        [sglang_python(), str(LOADER), str(tmp / "request.json"), str(out)],
        env=script_env(calls, spec.env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    good, renamed = json.loads((out / "result.json").read_text())
    with safe_open(str(drafter / WEIGHTS), "pt") as f:
        exported = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    return {
        "good": good,
        "renamed": renamed,
        "good_params": load_file(str(out / "0.safetensors")),
        "renamed_params": load_file(str(out / "1.safetensors")),
        "exported": exported,
        "vocab": vocab,
        "shim_calls": shim_calls(calls),
    }


def test_load_weights_writes_every_parameter_from_the_file(loaded) -> None:
    params, exported = loaded["good_params"], loaded["exported"]
    assert loaded["good"]["class"] == "LlamaForCausalLMEagle3"
    assert not_from_file(params, exported) == []
    # Every exported weight was used (d2t and t2d are read as the vocab map, not as parameters).
    used = {n for p in params if p != SHARED_WITH_TARGET for n in file_tensors(p)}
    assert used == set(exported) - {"d2t", "t2d"}
    assert torch.isnan(params[SHARED_WITH_TARGET]).all()  # not in the file, as intended
    assert loaded["shim_calls"] == []


def test_a_tensor_sglang_does_not_know_is_caught(loaded) -> None:
    # SGLang skipped the renamed tensor silently: half of gate_up_proj is still the NaN fill.
    assert not_from_file(loaded["renamed_params"], loaded["exported"]) == [f"{LAYER}.mlp.gate_up_proj.weight"]
    assert torch.isnan(loaded["renamed_params"][f"{LAYER}.mlp.gate_up_proj.weight"]).any()


def test_sglang_reads_the_vocab_map_geometry_and_capture_layers(loaded, smollm2) -> None:
    good, vocab = loaded["good"], loaded["vocab"]
    # hot_token_id = d2t + arange: the target id of each draft id, the draft vocab aerie chose.
    assert good["hot_token_id"] == vocab.used.tolist()
    assert good["hot_token_id"] != list(range(vocab.draft_vocab_size))
    assert (good["hidden_size"], good["vocab_size"]) == (
        smollm2.geometry.hidden_size,
        smollm2.geometry.vocab_size,
    )
    assert good["draft_vocab_size"] == good["lm_head_rows"] == vocab.draft_vocab_size
    assert good["aux_layer_ids"] == smollm2.aux_layers_output
    # The target then captures the residual stream entering these layers: what aerie extracted.
    assert good["target_capture_layers"] == smollm2.aux_layers_input
