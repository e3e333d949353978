"""The vLLM layout every EAGLE-3 export carries (DIR/vllm/, the `speculators` format), read back without
vLLM: the same tensors as SGLang's layout under speculators' names, and a config whose capture layers are
vLLM's convention (one more than SGLang's), whose residual rule is aerie's, and whose decoder layer is
SGLang's config's. That vLLM's own classes load it is `test_vllm_drafter.py` (needs `make setup-vllm`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aerie.deploy.work import promote
from aerie.draft.export import CONFIG, WEIGHTS
from aerie.draft.vllm_export import FOLDER, speculator_tensors, vllm_serve_argv
from aerie.errors import ConfigError
from aerie.evaluate.drafter_files import fetch_drafter
from aerie.manifest import StageResult
from aerie.presets import load_config
from aerie.store import LocalStore
from tests.test_sglang_drafter_load import exported_drafter


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, smollm2) -> Path:
    out, _ = exported_drafter(smollm2, tmp_path_factory.mktemp("vllm-export") / "drafter")
    return out


def test_the_vllm_folder_holds_sglangs_tensors_under_speculators_names(drafter) -> None:
    sglang = load_file(str(drafter / WEIGHTS))
    vllm = load_file(str(drafter / FOLDER / WEIGHTS))
    assert set(vllm) == {k.replace("midlayer.", "layers.0.") for k in sglang}
    assert not any(k.startswith("midlayer.") for k in vllm)
    for key, tensor in sglang.items():
        twin = vllm[key.replace("midlayer.", "layers.0.")]
        assert twin.dtype == tensor.dtype and torch.equal(twin, tensor), key


def test_speculator_names_leave_everything_but_the_layer_alone() -> None:
    t = torch.zeros(1)
    renamed = speculator_tensors({"midlayer.mlp.up_proj.weight": t, "fc.weight": t, "d2t": t})
    assert sorted(renamed) == ["d2t", "fc.weight", "layers.0.mlp.up_proj.weight"]


def test_the_speculators_config_says_what_vllm_reads(drafter, smollm2) -> None:
    sglang = json.loads((drafter / CONFIG).read_text())
    cfg = json.loads((drafter / FOLDER / CONFIG).read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["architectures"] == ["Eagle3Speculator"]
    # vLLM captures the stream entering a layer; SGLang's ids name the layer whose output it is.
    sglang_ids = sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in sglang_ids] == smollm2.aux_layers_input
    # vLLM's reader takes a missing norm_before_residual as true; aerie's layer is the other kind.
    assert cfg["norm_before_residual"] is False
    assert cfg["draft_vocab_size"] == sglang["draft_vocab_size"]
    assert cfg["target_hidden_size"] == smollm2.geometry.hidden_size
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama"  # vLLM maps llama to its Eagle3LlamaForCausalLM
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
    ):
        assert layer[field] == sglang[field], field
    assert layer["vocab_size"] == smollm2.geometry.vocab_size
    assert layer["tie_word_embeddings"] is False
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3"
    assert spec["default_proposal_method"] in [m["proposal_type"] for m in spec["proposal_methods"]]
    assert spec["verifier"] == {
        "name_or_path": smollm2.path,
        "architectures": [smollm2.geometry.architecture],
    }


def test_the_launch_line_names_the_vllm_folder() -> None:
    argv = vllm_serve_argv("/models/target", "/drafters/d", 3)
    assert argv[:3] == ["vllm", "serve", "/models/target"]
    assert argv[3] == "--speculative-config"
    assert json.loads(argv[4]) == {
        "method": "eagle3",
        "model": "/drafters/d/vllm",
        "num_speculative_tokens": 3,
    }


def test_a_copied_drafter_keeps_its_vllm_folder_apart(drafter, tmp_path) -> None:
    # A store whose files are not used in place (a copy lands in `dest`): vllm/config.json must not
    # replace SGLang's config.json, as a copy by bare file names would.
    store = LocalStore(tmp_path / "store")
    for path in drafter.rglob("*"):
        if path.is_file():
            store.put_file(f"run/train/k/drafter/{path.relative_to(drafter).as_posix()}", path)
    train = StageResult(
        stage="train",
        key="k",
        prefix="run/train/k",
        manifest_uri="",
        manifest_sha256="0" * 64,
        cache_hit=False,
        seconds=0.0,
    )
    dest = fetch_drafter(_CopyingStore(store), train, tmp_path / "copy")
    assert (dest / CONFIG).read_text() == (drafter / CONFIG).read_text()
    assert (dest / FOLDER / CONFIG).read_text() == (drafter / FOLDER / CONFIG).read_text()


def test_promotion_copies_the_vllm_folder_as_a_folder(drafter, tmp_path) -> None:
    store = LocalStore(tmp_path / "store")
    for path in drafter.rglob("*"):
        if path.is_file():
            store.put_file(f"run/train/k/drafter/{path.relative_to(drafter).as_posix()}", path)
    # The train stage's manifest, which the promoted copy's card is written from.
    store.put_bytes(
        "run/train/k/manifest.json", json.dumps({"stage": "train", "target": {"name": "t"}}).encode()
    )
    train = StageResult(
        stage="train", key="k", prefix="run/train/k", manifest_uri="", manifest_sha256="0" * 64,
        cache_hit=False, seconds=0.0,
    )  # fmt: skip
    prefix = promote(store, "run", train, None, {"promotion": {"speedup": 1.5, "concurrency": 1}}, "# report")
    promoted = tmp_path / "store" / prefix / "drafter"
    assert (promoted / CONFIG).read_text() == (drafter / CONFIG).read_text()
    assert (promoted / FOLDER / CONFIG).read_text() == (drafter / FOLDER / CONFIG).read_text()


class _CopyingStore:
    """A local store seen as a remote one: no file is offered in place, so `fetch_drafter` copies."""

    def __init__(self, store: LocalStore) -> None:
        self._store = store

    def list(self, prefix: str = "") -> list[str]:
        return self._store.list(prefix)

    def local_path(self, key: str) -> None:
        return None

    def get_file(self, key: str, path: Path) -> Path:
        return self._store.get_file(key, path)


def test_deploy_engine_vllm_is_refused_at_load_with_the_launch_line() -> None:
    with pytest.raises(ConfigError) as err:
        load_config("smollm2-local", ["deploy.engine=vllm"])
    message = str(err.value)
    assert "deploy.engine 'vllm'" in message and "/generate" in message
    assert "vllm serve TARGET --speculative-config" in message and "DRAFTER_DIR/vllm" in message
    # Without the deploy stage nothing needs a vLLM benchmark; the default engine loads as before.
    assert (
        load_config("smollm2-local", ["deploy.engine=vllm", "deploy.enabled=false"]).deploy.engine == "vllm"
    )
    assert load_config("smollm2-local", []).deploy.engine == "sglang"
