"""The SGLang dump plugin, every piece that runs without SGLang and a GPU.

SGLang itself cannot be installed on this machine (no GPU; its wheel pulls CUDA kernels), so:
- argument rewriting, the version check, the per-request split of a packed batch, the dump writer,
  the entry-point registration and the launcher's refusals run for real here;
- the SGLang classes the plugin patches are checked against the pinned release's *source*
  (`test_attach_points_exist_in_pinned_source`, which needs the unpacked wheel: set AERIE_SGLANG_SRC
  to its `sglang/` dir, e.g. after `pip download --no-deps sglang==0.5.23 -d /tmp/sgl` and unzip;
  skipped otherwise);
- `enable_aux_capture` runs on small stand-in models whose `set_eagle3_layers_to_capture` copy the
  two conventions of SGLang's llama.py and deepseek_v2.py (a stand-in only because SGLang's models
  need SGLang's distributed runtime to construct).
The attach itself inside a live server is proven by the extraction canary on the GPU host.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aerie.errors import ServerLaunchError
from aerie.sglang_plugin import dumps
from aerie.sglang_plugin.capture import CaptureState, enable_aux_capture
from aerie.sglang_plugin.compat import ATTACH_POINTS, SUPPORTED_SGLANG, check_sglang_version
from aerie.sglang_plugin.launch import PLUGIN_GROUP, child_env, register_plugin, rewrite_args
from aerie.sglang_plugin.layers import eagle3_layers

REPO = Path(__file__).resolve().parent.parent
BASE = ["--model-path", "/m", "--port", "30000", "--weight-version", "run-abc"]


# ---- argument rewriting -------------------------------------------------------------------------


def test_rewrite_adds_extraction_flags_and_takes_the_dump_dir():
    plan = rewrite_args([*BASE, "--tp-size", "8", "--dump-dir", "/d"], environ={})
    assert plan.dump_dir == Path("/d")
    assert "--dump-dir" not in plan.argv
    for switch in ("--skip-tokenizer-init", "--disable-radix-cache", "--disable-prefill-cuda-graph"):
        assert plan.argv.count(switch) == 1
    i = plan.argv.index("--chunked-prefill-size")
    assert plan.argv[i + 1] == "-1"
    assert plan.argv[:8] == [*BASE, "--tp-size", "8"]  # the caller's arguments keep their order


def test_rewrite_accepts_the_full_command_line_a_launcher_passes():
    # aerie's docker launcher passes `python3 -m aerie.sglang_plugin.launch ...` as the container
    # command, and the image's ENTRYPOINT is that same command.
    full = ["python3", "-m", "aerie.sglang_plugin.launch", *BASE, "--dump-dir", "/d"]
    assert rewrite_args(full, environ={}).argv == rewrite_args(full[3:], environ={}).argv
    with pytest.raises(ServerLaunchError, match="unexpected argument 'serve'"):
        rewrite_args(["serve", *BASE, "--dump-dir", "/d"], environ={})


def test_rewrite_forces_whole_sample_prefill_and_keeps_given_flags_once():
    argv = [*BASE, "--chunked-prefill-size=8192", "--skip-tokenizer-init", "--mem-fraction-static", "0.8"]
    plan = rewrite_args(argv, environ={"AERIE_DUMP_DIR": "/env-dir"})
    assert plan.dump_dir == Path("/env-dir")
    i = plan.argv.index("--chunked-prefill-size")
    assert plan.argv[i + 1] == "-1" and plan.argv.count("--chunked-prefill-size") == 1
    assert plan.argv.count("--skip-tokenizer-init") == 1
    assert plan.argv[plan.argv.index("--mem-fraction-static") + 1] == "0.8"
    assert any("8192 replaced by -1" in n for n in plan.notes)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--speculative-algorithm", "EAGLE3"], "draft"),
        (["--enable-dp-attention"], "DP attention"),
        (["--pp-size", "2"], "pipeline parallelism"),
    ],
)
def test_rewrite_refuses_what_would_split_or_change_the_states(extra, message):
    with pytest.raises(ServerLaunchError, match=message):
        rewrite_args([*BASE, *extra, "--dump-dir", "/d"], environ={})


def test_rewrite_needs_nonce_model_and_dump_dir():
    with pytest.raises(ServerLaunchError, match="weight-version run-<nonce>"):
        rewrite_args(["--model-path", "/m", "--dump-dir", "/d"], environ={})
    with pytest.raises(ServerLaunchError, match="model-path"):
        rewrite_args(["--weight-version", "run-x", "--dump-dir", "/d"], environ={})
    with pytest.raises(ServerLaunchError, match="no dump dir"):
        rewrite_args(BASE, environ={})


# ---- version check ------------------------------------------------------------------------------


def test_version_check():
    assert check_sglang_version(SUPPORTED_SGLANG[0], environ={}) == SUPPORTED_SGLANG[0]
    with pytest.raises(ServerLaunchError, match=r"sglang 0\.5\.14 is not a version"):
        check_sglang_version("0.5.14", environ={})
    assert check_sglang_version("0.5.14", environ={"AERIE_SGLANG_ALLOW_UNTESTED": "1"}) == "0.5.14"
    with pytest.raises(ServerLaunchError, match="not installed"):
        check_sglang_version(None, environ={})


@pytest.mark.integration
def test_launcher_refuses_to_start_without_the_pinned_sglang(tmp_path):
    # A real process: the entrypoint exits 2 with the reason before anything is launched.
    proc = subprocess.run(
        [sys.executable, "-m", "aerie.sglang_plugin.launch", *BASE, "--dump-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "sglang is not installed" in proc.stderr


# ---- dump files ---------------------------------------------------------------------------------


def test_write_dump_is_atomic_and_round_trips(tmp_path, monkeypatch):
    ids = torch.arange(5)
    aux, last = torch.randn(5, 12).bfloat16(), torch.randn(5, 4).bfloat16()
    meta = dumps.write_dump(tmp_path, "r-1", ids, aux, last)
    assert meta == {
        "key": "r-1.safetensors",
        "shapes": {"input_ids": [5], "aux_hidden": [5, 12], "last_hidden": [5, 4]},
        "dtype": "bfloat16",
    }
    got = dumps.read_dump(tmp_path / "r-1.safetensors")
    assert got["input_ids"].dtype == torch.int32 and got["input_ids"].tolist() == list(range(5))
    assert torch.equal(got["aux_hidden"], aux) and torch.equal(got["last_hidden"], last)

    # A failure before the rename leaves neither the dump nor its temp file.
    def fail(tmp, dest):
        raise OSError("disk full")

    monkeypatch.setattr(dumps, "_atomic_replace", fail)
    with pytest.raises(OSError):
        dumps.write_dump(tmp_path, "r-2", ids, aux, last)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r-1.safetensors"]
    with pytest.raises(ValueError, match="cannot name a dump file"):
        dumps.dump_path(tmp_path, "../escape")


def packed_batch(lengths, h=4):
    total = sum(lengths)
    ids = torch.arange(total)
    last = torch.randn(total, h)
    aux = [torch.randn(total, h) for _ in range(3)]  # the list form SGLang's llama passes
    return ids, last, aux


def test_capture_splits_a_packed_batch_per_request(tmp_path):
    state = CaptureState(tmp_path)
    for rid in ("a", "b", "c"):
        state.note_request(rid, 0)
    state.note_request("warmup", 8)  # generates tokens: not a dump request
    ids, last, aux = packed_batch([3, 1, 5, 2])
    n = state.capture(ids, last, ["a", "warmup", "b", "c"], [3, 1, 5, 2], [0, 0, 0, 0], aux)
    state.writer.flush()
    assert n == 3 and not state.pending
    cat = torch.cat(aux, -1)
    for rid, (start, end) in {"a": (0, 3), "b": (4, 9), "c": (9, 11)}.items():
        got = dumps.read_dump(tmp_path / f"{rid}.safetensors")
        assert got["input_ids"].tolist() == list(range(start, end))
        assert torch.equal(got["aux_hidden"], cat[start:end])
        assert torch.equal(got["last_hidden"], last[start:end])
    assert not (tmp_path / "warmup.safetensors").exists()


def test_capture_reports_partial_prefill_and_missing_aux(tmp_path):
    state = CaptureState(tmp_path)
    state.note_request("cached", 0)
    state.note_request("noaux", 0)
    ids, last, aux = packed_batch([4])
    state.capture(ids, last, ["cached"], [4], [7], aux)
    state.capture(ids, last, ["noaux"], [4], [0], None)
    state.writer.flush()
    assert "reused 7 cached tokens" in (tmp_path / "cached.error").read_text()
    assert "no aux hidden states" in (tmp_path / "noaux.error").read_text()
    assert not list(tmp_path.glob("*.safetensors"))


def test_only_tp_rank_zero_writes(tmp_path):
    state = CaptureState(tmp_path, rank_fn=lambda: 1)
    state.note_request("a", 0)
    ids, last, aux = packed_batch([2])
    assert state.capture(ids, last, ["a"], [2], [0], aux) == 0
    assert not state.pending and not list(tmp_path.iterdir())


# ---- aux capture conventions --------------------------------------------------------------------


class _Inner:
    layers_to_capture: list[int] = []


class _Config:
    num_hidden_layers = 30


class LlamaLike:
    """Copies SGLang 0.5.23 models/llama.py set_eagle3_layers_to_capture (explicit ids: +1)."""

    config = _Config()

    def __init__(self):
        self.model = _Inner()

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.model.layers_to_capture = [v + 1 for v in layer_ids]


class DeepseekLike(LlamaLike):
    """Copies models/deepseek_v2.py: +1 only when the first id is 1."""

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        if layer_ids and layer_ids[0] == 1:
            self.model.layers_to_capture = [v + 1 for v in layer_ids]
        else:
            self.model.layers_to_capture = list(layer_ids)


class InputConvention(LlamaLike):
    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.model.layers_to_capture = list(layer_ids)


def test_aux_capture_resolves_to_inputs_of_2_n2_n3_on_both_conventions():
    assert eagle3_layers(30) == [1, 14, 26]
    assert eagle3_layers(61) == [1, 29, 57]  # Kimi-K2.5
    for model in (LlamaLike(), DeepseekLike()):
        assert enable_aux_capture(model, environ={}) == [2, 15, 27]
        assert model.model.layers_to_capture == [2, 15, 27]
    with pytest.raises(RuntimeError, match=r"layers_to_capture=\[1, 14, 26\], expected \[2, 15, 27\]"):
        enable_aux_capture(InputConvention(), environ={})


# ---- plugin registration ------------------------------------------------------------------------


@pytest.mark.integration
def test_entry_point_is_found_and_loads_install_in_a_child_process(tmp_path):
    site = register_plugin(tmp_path / "site")
    dump_dir = tmp_path / "dumps"
    dump_dir.mkdir()
    env = child_env({**os.environ, "SGLANG_PLUGINS": "other"}, site, dump_dir)
    assert env["SGLANG_PLUGINS"] == "other,aerie_dump"
    code = (
        "from importlib.metadata import entry_points\n"
        f"(ep,) = [e for e in entry_points(group={PLUGIN_GROUP!r}) if e.name == 'aerie_dump']\n"
        "fn = ep.load()\n"
        "print(fn.__module__, fn.__name__)\n"
        "try:\n"
        "    fn()\n"
        "except Exception as exc:\n"
        "    print('refused:', exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "aerie.sglang_plugin.capture install" in proc.stdout
    # No sglang here: install refuses, and leaves a file the extraction client reads at once.
    assert "refused: sglang is not installed" in proc.stdout
    assert "sglang is not installed" in (dump_dir / dumps.PLUGIN_ERROR_FILE).read_text()


# ---- checked against the pinned release's source ------------------------------------------------


def _sglang_src() -> Path | None:
    for cand in (os.environ.get("AERIE_SGLANG_SRC"), "/tmp/sgl/src/sglang"):
        if cand and (Path(cand) / "srt").is_dir():
            return Path(cand)
    return None


def _tree(src: Path, module: str) -> ast.Module:
    rel = Path(*module.split(".")[1:]).with_suffix(".py")
    return ast.parse((src / rel).read_text())


def _find(tree: ast.Module, attr_path: str) -> ast.AST | None:
    nodes: list[ast.AST] = list(tree.body)
    found: ast.AST | None = None
    for part in attr_path.split("."):
        found = None
        for node in nodes:
            name = getattr(node, "name", None)
            if (
                name == part
                or isinstance(node, ast.ImportFrom)
                and any((a.asname or a.name) == part for a in node.names)
            ):
                found = node
        if found is None:
            return None
        nodes = list(getattr(found, "body", []))
    return found


@pytest.mark.skipif(_sglang_src() is None, reason="the unpacked sglang==0.5.23 source is not here")
def test_attach_points_exist_in_pinned_source():
    src = _sglang_src()
    assert src is not None
    version = (src / "version.py").read_text() + (src / "_version.py").read_text()
    assert SUPPORTED_SGLANG[0] in version
    for module, attr in ATTACH_POINTS:
        assert _find(_tree(src, module), attr) is not None, f"{module}:{attr} moved"
    # LogitsProcessor.forward's positional order, which the wrapper relies on.
    fwd = _find(_tree(src, "sglang.srt.layers.logits_processor"), "LogitsProcessor.forward")
    assert isinstance(fwd, ast.FunctionDef)
    assert [a.arg for a in fwd.args.args][:6] == [
        "self",
        "input_ids",
        "hidden_states",
        "lm_head",
        "logits_metadata",
        "aux_hidden_states",
    ]
    # The ForwardBatch fields the split reads.
    fb = ast.unparse(_find(_tree(src, "sglang.srt.model_executor.forward_batch_info"), "ForwardBatch"))
    for field in ("rids:", "extend_seq_lens_cpu:", "extend_prefix_lens_cpu:", "forward_mode:"):
        assert field in fb
    # The runner calls the (patched) module-level name before CUDA-graph capture.
    runner = (src / "srt/model_executor/model_runner.py").read_text()
    assert "configure_aux_hidden_state_capture(\n            model=self.model" in runner
    # The flags the launcher adds exist.
    fields = "".join(p.read_text() for p in (src / "srt/arg_groups/fields").glob("*.py"))
    for name in ("skip_tokenizer_init", "chunked_prefill_size", "disable_radix_cache", "weight_version"):
        assert f"    {name}:" in fields
    assert "disable_prefill_cuda_graph:" in fields
    # llama's explicit-id convention is the one the stand-in copies.
    llama = (src / "srt/models/llama.py").read_text()
    assert "self.model.layers_to_capture = [val + 1 for val in layer_ids]" in llama
