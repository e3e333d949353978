"""Every target architecture's exported drafters as SGLang 0.5.23 loads them: for each tiny target of
tests/tiny_targets.py (Llama-3, Qwen3, Qwen3-MoE, DeepSeek-V3, Kimi-shaped, GPT-OSS), an EAGLE-3 drafter
and a DFlash drafter of the geometry aerie builds for it (`train.draft`'s defaults: for the MLA targets
one head per target head, `v_head_dim` wide), exported by aerie's exporters and loaded in one SGLang
process by SGLang's own classes (`LlamaForCausalLMEagle3`, `DFlashDraftModel`) through its own model
loader and `load_weights`, under the speculative server arguments aerie gives SGLang for that target.

The drafters are freshly initialised with random weights, not trained: loading checks names, shapes and
the config SGLang reads, which training does not change (the pipeline tests train and export drafters
through the reference server). Every parameter starts as NaN and must hold the file's tensor after the
load. The layers each target captures come from the target's own SGLang class (built on the meta
device) given the layer ids SGLang reads from the drafter's config; they must be the ones aerie extracts.

The MLA and GPT-OSS targets' server arguments are the GPU ones (SGLang on the CPU refuses them, see
tests/test_architectures.py) with SGLang's CPU flags added for this load; nothing here runs a forward."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from aerie.deploy.work import server_specs
from aerie.draft.export import WEIGHTS as DFLASH_WEIGHTS
from aerie.engine.speculative.dflash import hidden_state_indices
from aerie.presets import load_config
from aerie.serving.spec import SGLANG_CPU_ENV, sglang_cpu_args
from aerie.targets import TargetConfig, TargetInfo, resolve_target
from tests import test_dflash_sglang as dflash_load
from tests import test_sglang_drafter_load as eagle3_load
from tests.sglang_support import REPO, script_env, sglang_argv, sglang_python, shim_calls
from tests.tiny_targets import ARCHITECTURES, MLA, build_target

pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(900)]

LOADER = Path(__file__).with_name("architectures_sglang_load.py")
PAD = 64  # SGLang's ParallelLMHead pads its vocabulary to a multiple of this


# Targets SGLang 0.5.23 does not run on the CPU: MLA (DeepSeek-V3, Kimi) and GPT-OSS, whose class
# SGLang's argument checks give only GPU attention backends (or intel_amx, which needs Intel AMX).
GPU_ONLY = MLA | {"gpt_oss"}


def launch_argv(target: TargetInfo, drafter: Path, arch: str) -> tuple[list[str], dict[str, str]]:
    """The speculative SGLang launch's arguments and environment aerie builds for `target`; for a
    target SGLang runs on GPUs only, the GPU's with SGLang's CPU flags added for this load, the
    attention backend one SGLang accepts for the class (triton; no attention runs here)."""
    device = "cuda" if arch in GPU_ONLY else "cpu"
    cfg = load_config("smollm2-local", ["server.backend=sglang", f"server.device={device}"])
    spec = server_specs(cfg.deploy, cfg.server, target, str(drafter))["speculative"]
    argv = sglang_argv(spec)
    if device == "cuda":
        argv += sglang_cpu_args([*argv, "--attention-backend"]) + ["--attention-backend", "triton"]
    return argv, {**spec.env, **SGLANG_CPU_ENV}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, smollm2) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("architectures-sglang")
    jobs, env, exported = [], dict(SGLANG_CPU_ENV), {}
    for arch in ARCHITECTURES:
        path = build_target(arch, tmp / arch / "target", smollm2.path)
        target = resolve_target(TargetConfig(name=str(path), trust_remote_code=arch == "kimi"))
        eagle3, vocab = eagle3_load.exported_drafter(target, tmp / arch / "eagle3")
        dflash = dflash_load.exported(target, tmp / arch / "dflash")
        argv, launch_env = launch_argv(target, eagle3, arch)
        env.update(launch_env)
        jobs.append({"name": arch, "argv": argv, "eagle3": str(eagle3), "dflash": str(dflash)})
        exported[arch] = {"target": target, "vocab": vocab, "eagle3": eagle3, "dflash": dflash}
    (tmp / "request.json").write_text(json.dumps({"targets": jobs}))
    out = tmp / "out"
    out.mkdir()
    calls = tmp / "shim-calls"
    env = script_env(calls, env)
    env["PYTHONPATH"] += os.pathsep + str(REPO)  # the loader gives SGLang aerie's DeepSeek config default
    run = subprocess.run(
        [sglang_python(), str(LOADER), str(tmp / "request.json"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return {
        "result": json.loads((out / "result.json").read_text()),
        "out": out,
        "exported": exported,
        "shim_calls": shim_calls(calls),
    }


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sglang_loads_the_eagle3_drafter_of_every_architecture(loaded, arch: str) -> None:
    got, mine = loaded["result"][arch]["eagle3"], loaded["exported"][arch]
    target, vocab = mine["target"], mine["vocab"]
    assert got["class"] == "LlamaForCausalLMEagle3"
    params = load_file(str(loaded["out"] / arch / "eagle3.safetensors"))
    tensors = load_file(str(mine["eagle3"] / eagle3_load.WEIGHTS))
    # SGLang pads the head's rows to a multiple of 64 (the Kimi-shaped target's vocabulary is 595);
    # the rows past the vocabulary are never read.
    rows = tensors["lm_head.weight"].shape[0]
    assert params["lm_head.weight"].shape[0] == -(-rows // PAD) * PAD
    params["lm_head.weight"] = params["lm_head.weight"][:rows]
    assert eagle3_load.not_from_file(params, tensors) == []
    used = {n for p in params if p != eagle3_load.SHARED_WITH_TARGET for n in eagle3_load.file_tensors(p)}
    assert used == set(tensors) - {"d2t", "t2d"}
    # The drafter's attention is the geometry aerie chose: SGLang's fused qkv has its rows.
    shape = load_config("smollm2-local", []).train.draft.resolve(target.geometry)
    qkv = params[f"{eagle3_load.LAYER}.self_attn.qkv_proj.weight"]
    assert qkv.shape == (
        (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim,
        2 * target.geometry.hidden_size,
    )
    assert got["hot_token_id"] == vocab.used.tolist()
    assert (got["hidden_size"], got["vocab_size"]) == (
        target.geometry.hidden_size,
        target.geometry.vocab_size,
    )
    assert got["aux_layer_ids"] == target.aux_layers_output
    # The target's own SGLang class then captures the residual stream entering these layers: what aerie
    # extracted (DeepSeek's hook shifts the ids only when the first is 1; aerie's first is).
    assert got["target_capture_layers"] == target.aux_layers_input
    assert loaded["shim_calls"] == []


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sglang_loads_the_dflash_drafter_of_every_architecture(loaded, arch: str) -> None:
    got, mine = loaded["result"][arch]["dflash"], loaded["exported"][arch]
    target = mine["target"]
    assert got["class"] == "DFlashDraftModel"
    params = load_file(str(loaded["out"] / arch / "dflash.safetensors"))
    tensors = load_file(str(mine["dflash"] / DFLASH_WEIGHTS))
    assert dflash_load.not_from_file(params, tensors) == []
    ids = json.loads((mine["dflash"] / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    assert got["target_layer_ids"] == ids and got["num_layers"] == 2
    assert got["num_context_features"] == len(ids)
    # The states the target's own class captures for DFlash are the ones aerie's DFlash reads.
    assert got["target_capture_layers"] == hidden_state_indices(ids)
    assert all(0 < i <= target.geometry.num_layers for i in got["target_capture_layers"])
    assert not torch.isnan(params["fc.weight"]).any()
