"""The drafter `kimi-k2.5-8gpu` would export, as SGLang 0.5.23 builds it: aerie's config.json for it
(from the Kimi-K2.5 config.json aerie ships, through the same geometry and `train.draft` code as any
target) given to SGLang's own `LlamaForCausalLMEagle3` by its model loader, on torch's meta device at the
real sizes (hidden 7168, 64 heads of 128, MLP 12288, draft vocab 32000 of 163840): no memory, no weights.
Every parameter SGLang builds must have the shape of the exported tensors it is loaded from (aerie's
export names, q/k/v and gate/up fused as SGLang fuses them), SGLang must read the target's YaRN RoPE,
and Kimi-K2.5's own SGLang class (`KimiK25ForConditionalGeneration`, also on the meta device) must
capture the layers aerie extracts.

The server arguments are the preset's (`server.launcher=process` to get SGLang's own argument list
rather than a container's) at tensor parallel 1, so SGLang builds whole, unsharded parameters, with
SGLang's CPU flags added: nothing here runs on a GPU or a forward."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from aerie.deploy.work import server_specs
from aerie.draft.export import EXPORT_KEYS, draft_config_for, hf_config
from aerie.presets import load_config
from aerie.serving.spec import SGLANG_CPU_ENV, sglang_cpu_args
from aerie.targets import TargetInfo, geometry_of, known_target_dir
from tests.sglang_support import REPO, script_env, sglang_argv, sglang_python, shim_calls
from tests.test_sglang_drafter_load import SHARED_WITH_TARGET, file_tensors

pytestmark = pytest.mark.sglang

HELPER = Path(__file__).with_name("sglang_drafter_meta.py")
PRESET = "kimi-k2.5-8gpu"


def kimi_target() -> TargetInfo:
    """Kimi-K2.5 as aerie knows it without its weights: the shipped config.json's geometry and ids."""
    cfg = load_config(PRESET, [])
    folder = known_target_dir(cfg.target.name)
    assert folder is not None
    raw = json.loads((folder / "config.json").read_text())
    return TargetInfo(
        name=cfg.target.name,
        path=str(folder),
        revision="config.json only",
        geometry=geometry_of(folder),
        eos_token_ids=[raw["eos_token_id"]],
        bos_token_id=raw["bos_token_id"],
        pad_token_id=raw["pad_token_id"],
        chat_template_sha256="",
        size_bytes=0,
        trust_remote_code=cfg.target.trust_remote_code,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("kimi-drafter")
    cfg = load_config(PRESET, ["server.launcher=process"])
    target = kimi_target()
    draft = draft_config_for(
        target, cfg.train.drafter.draft_vocab_size, cfg.train.draft.resolve(target.geometry)
    )
    drafter = tmp / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(hf_config(draft, target), indent=2))
    spec = server_specs(cfg.deploy, cfg.server, target, str(drafter))["speculative"]
    argv = sglang_argv(spec)
    argv[argv.index("--tp-size") + 1] = "1"
    argv += sglang_cpu_args(argv)
    (tmp / "request.json").write_text(json.dumps({"argv": argv, "drafter": str(drafter)}))
    calls = tmp / "shim-calls"
    env = script_env(calls, {**spec.env, **SGLANG_CPU_ENV})
    env["PYTHONPATH"] += os.pathsep + str(REPO)  # the helper gives SGLang aerie's DeepSeek config defaults
    run = subprocess.run(
        [sglang_python(), str(HELPER), str(tmp / "request.json"), str(tmp / "out.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return {
        "sglang": json.loads((tmp / "out.json").read_text()),
        "draft": draft,
        "target": target,
        "shim_calls": shim_calls(calls),
    }


def test_sglang_builds_the_kimi_drafter_with_the_exported_shapes(built) -> None:
    sglang, draft = built["sglang"], built["draft"]
    assert sglang["class"] == "LlamaForCausalLMEagle3" and sglang["device"] == "meta"
    assert (draft.num_attention_heads, draft.num_key_value_heads, draft.head_dim) == (64, 64, 128)
    assert (draft.hidden_size, draft.intermediate_size, draft.draft_vocab_size) == (7168, 12288, 32000)
    exported = {key: tuple(shape(draft)) for key, shape in EXPORT_KEYS.items()}
    used = set()
    for param, shape in sglang["params"].items():
        if param == SHARED_WITH_TARGET:  # the target's embedding, handed over at serve time
            assert shape == [draft.vocab_size, draft.hidden_size]
            continue
        names = file_tensors(param)
        assert all(n in exported for n in names), (param, names)
        rows = sum(exported[n][0] for n in names)
        assert (rows, *exported[names[0]][1:]) == tuple(shape), (param, shape, names)
        used.update(names)
    assert used == set(exported) - {"d2t", "t2d"}  # the vocab map is read as a buffer, not a parameter
    assert (sglang["hidden_size"], sglang["vocab_size"], sglang["draft_vocab_size"]) == (7168, 163840, 32000)
    assert built["shim_calls"] == []


def test_sglang_reads_kimis_yarn_rope_and_capture_layers(built) -> None:
    rope, target = built["sglang"]["rope"], built["target"]
    assert "YaRN" in rope["class"], rope
    assert (rope["base"], rope["rotary_dim"], rope["scaling_factor"]) == (50000.0, 128, 64.0)
    assert built["sglang"]["target_class"] == "KimiK25ForConditionalGeneration"
    assert built["sglang"]["aux_layer_ids"] == target.aux_layers_output == [1, 29, 57]
    assert built["sglang"]["target_capture_layers"] == target.aux_layers_input == [2, 30, 58]
