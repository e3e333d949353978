"""What aerie refuses about an SGLang launch, before it waits, against real interpreters: an SGLang of
another version than the tested one, no SGLang environment at all; and a model SGLang's CPU engine
cannot load, reported in SGLang's own words as soon as SGLang says them, not at the deadline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from aerie.errors import ServerCrashedError, ServerLaunchError
from aerie.serving import ModelServer, ServerConfig, spec_for
from aerie.serving.spec import SGLANG_VENV, sglang_python
from tests.processes import free_port
from tests.sglang_support import SHIMS, VERSION, cpu_config, shim_env
from tests.sglang_support import sglang_python as sglang_env_python

pytestmark = pytest.mark.integration

OTHER_VERSION = "0.5.14"


@pytest.mark.sglang
def test_an_untested_sglang_version_is_refused_before_launch_naming_both(smollm2, tmp_path: Path) -> None:
    sglang_env_python()
    # SGLang's own environment, with a distribution record of another version ahead of its own on the
    # path: importlib.metadata (what the check reads, as the plugin does) finds that one first.
    info = tmp_path / "older" / f"sglang-{OTHER_VERSION}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {OTHER_VERSION}\n")
    env = shim_env(tmp_path / "calls.txt")
    env["PYTHONPATH"] = f"{info.parent}:{SHIMS}"
    cfg = cpu_config(free_port(), tmp_path / "calls.txt", env=env)
    spec = spec_for(cfg, model_path=smollm2.path, log_path=tmp_path / "server.log")
    with pytest.raises(ServerLaunchError) as err:
        ModelServer(spec).start()
    message = str(err.value)
    assert f"sglang {OTHER_VERSION} in " in message and f"not the tested sglang {VERSION}" in message
    assert "make setup-sglang" in message and "\n" not in message
    assert not spec.log_path.exists()  # refused before anything was launched


def test_no_sglang_environment_is_one_line_naming_the_setup_command(smollm2, tmp_path: Path) -> None:
    # aerie's own interpreter has no SGLang (it lives in its own environment).
    for python in (sys.executable, str(tmp_path / "no-env" / "bin" / "python")):
        cfg = ServerConfig(backend="sglang", device="cpu", python=python, port=free_port())
        spec = spec_for(cfg, model_path=smollm2.path, log_path=tmp_path / "server.log")
        with pytest.raises(ServerLaunchError) as err:
            ModelServer(spec).start()
        message = str(err.value)
        assert message.startswith("no sglang") and "`make setup-sglang`" in message, message
        assert "\n" not in message and not spec.log_path.exists()


def test_without_server_python_sglang_runs_from_its_own_environment() -> None:
    python = sglang_python(ServerConfig(backend="sglang"))
    if (SGLANG_VENV / "bin" / "python").exists():
        assert python == str(SGLANG_VENV / "bin" / "python")
    else:
        assert python == sys.executable  # and the launch preflight refuses it, as above
    assert sglang_python(ServerConfig(backend="sglang", python="/opt/x/python")) == "/opt/x/python"


def unloadable_model(smollm2, where: Path) -> Path:
    """The embedded target under an architecture SGLang's CPU engine does not register: its Grok module
    needs sgl_kernel's compiled CPU MoE router (`torch.ops.sgl_kernel.fused_moe_router_cpu`), so on this
    CPU SGLang skips it at import ("Ignore import error when loading sglang.srt.models.grok")."""
    model = where / "grok-on-cpu"
    model.mkdir()
    for source in Path(smollm2.path).iterdir():
        if source.name != "config.json":
            (model / source.name).symlink_to(source)
    config = json.loads((Path(smollm2.path) / "config.json").read_text())
    config["architectures"] = ["GrokForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.sglang
@pytest.mark.slow
def test_a_model_sglang_cannot_load_is_reported_in_its_own_words(smollm2, tmp_path: Path) -> None:
    model = unloadable_model(smollm2, tmp_path)
    cfg = cpu_config(free_port(), tmp_path / "calls.txt", startup_timeout_s=900)
    spec = spec_for(cfg, model_path=str(model), log_path=tmp_path / "server.log")
    with pytest.raises(ServerCrashedError) as err:
        ModelServer(spec).start()
    message = str(err.value)
    head = message.split("\nlast lines of")[0]
    # SGLang's own line: with no native model class it tries the transformers backend, which has none.
    assert "ValueError: Cannot find model module. 'GrokForCausalLM' is not a registered model" in head, (
        message
    )
    assert "cause: ValueError" in head and "into its start" in head
    assert not err.value.after_ready
