"""Every SGLang command line aerie builds, parsed by SGLang's own server parser (the pinned version, in its
own environment, one process for all of them): extraction (through the dump plugin's launcher, as SGLang
receives it), generation, deployment's baseline and speculative servers, for the embedded default on the
CPU (also resolved against the model, as the server does before it starts), the GPU preset and the Kimi
preset at TP 8 (parsed only: their targets are not on this machine). A flag SGLang removed or renamed
fails here, not on an 8-GPU host; a misspelt one is shown to fail."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from aerie.config import PipelineConfig
from aerie.deploy.work import server_specs
from aerie.draft.export import export_drafter
from aerie.extract.fleet import server_spec
from aerie.generate.server import generation_spec
from aerie.presets import load_config
from aerie.serving import ServerSpec
from aerie.targets import TargetInfo
from tests.evaluate_support import random_drafter
from tests.sglang_support import script_env, sglang_argv, sglang_python

pytestmark = pytest.mark.sglang

CHECK = Path(__file__).with_name("sglang_args_check.py")
# (preset, overrides, whether its generation launches a server: Kimi's goes to OpenRouter). The GPU
# preset's own settings for the reference server are cleared, as the config requires. The first is the
# CPU lane's.
PRESETS = [
    ("smollm2-local", ["server.backend=sglang"], True),
    (
        "smollm2-gpu",
        ["server.backend=sglang", "extract.quantize_on_server=false", "generate.endpoint.launch_args=[]"],
        True,
    ),
    ("kimi-k2.5-8gpu", [], False),
]
CPU_PRESET = PRESETS[0][0]


def preset_target(cfg: PipelineConfig, smollm2: TargetInfo) -> TargetInfo:
    """The embedded target itself, or (a target not on this machine) its facts under the preset's name:
    a launch reads only the path and trust_remote_code."""
    if cfg.target.name == smollm2.name:
        return smollm2
    return smollm2.model_copy(
        update={
            "name": cfg.target.name,
            "path": cfg.target.name,
            "trust_remote_code": cfg.target.trust_remote_code,
        }
    )


def preset_specs(
    preset: str, overrides: list[str], generates: bool, smollm2: TargetInfo, tmp: Path
) -> dict[str, ServerSpec]:
    cfg = load_config(preset, overrides)
    target = preset_target(cfg, smollm2)
    drafter = export_drafter(random_drafter(smollm2), tmp / f"{preset}-drafter", smollm2)
    specs = {
        "extract": server_spec(
            cfg.extract,
            cfg.server,
            target,
            index=0,
            local=0,
            num_local=1,
            attempt=0,
            dump_dir=tmp / f"{preset}-dumps",
            log_dir=tmp / f"{preset}-logs",
        ),
        **server_specs(cfg.deploy, cfg.server, target, str(drafter)),
    }
    if generates:
        specs["generate"] = generation_spec(cfg, target)
    return {f"{preset} {role}": spec for role, spec in specs.items()}


def misspelt(argv: list[str]) -> list[str]:
    return ["--tp-szie" if arg == "--tp-size" else arg for arg in argv]


def mistyped(argv: list[str]) -> list[str]:
    return [*argv, "--max-running-requests", "many"]


@pytest.fixture(scope="module")
def checked(tmp_path_factory, smollm2) -> tuple[dict[str, ServerSpec], dict[str, dict[str, Any]]]:
    """aerie's launches and what SGLang's parser made of each (plus two broken ones), in one process."""
    tmp = tmp_path_factory.mktemp("sglang-args")
    specs: dict[str, ServerSpec] = {}
    for preset, overrides, generates in PRESETS:
        specs.update(preset_specs(preset, overrides, generates, smollm2, tmp))
    assert all(spec.module != "aerie.engine" for spec in specs.values()), "a launch is not SGLang's"
    commands = [
        # The CPU lane's are resolved too: SGLang then reads the model's config as its server would.
        {"name": name, "argv": sglang_argv(spec), "resolve": name.startswith(f"{CPU_PRESET} ")}
        for name, spec in specs.items()
    ]
    local = sglang_argv(specs[f"{CPU_PRESET} extract"])
    commands += [
        {"name": "misspelt", "argv": misspelt(local), "resolve": False},
        {"name": "mistyped", "argv": mistyped(local), "resolve": False},
        {"name": "retired", "argv": [*local, "--disable-cuda-graph"], "resolve": False},
    ]
    (tmp / "commands.json").write_text(json.dumps(commands))
    env = script_env(tmp / "shim-calls", {k: v for spec in specs.values() for k, v in spec.env.items()})
    run = subprocess.run(
        [sglang_python(), str(CHECK), str(tmp / "commands.json"), str(tmp / "results.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return specs, json.loads((tmp / "results.json").read_text())


def test_sglang_accepts_every_command_aerie_builds(checked) -> None:
    specs, results = checked
    refused = {name: results[name]["error"] for name in specs if results[name]["error"]}
    assert not refused, "\n".join(
        f"{n}: {e}\n  {' '.join(sglang_argv(specs[n]))}" for n, e in refused.items()
    )
    resolved = sorted(name for name in specs if results[name]["resolved"])
    assert resolved == [
        f"{CPU_PRESET} {r}" for r in ("baseline", "extract", "generate", "ngram", "speculative")
    ]


def test_no_command_uses_a_flag_sglang_retires(checked) -> None:
    specs, results = checked
    retired = {name: results[name]["deprecated"] for name in specs if results[name]["deprecated"]}
    assert not retired, retired


def test_sglang_reads_the_values_aerie_meant(checked) -> None:
    specs, results = checked
    for name, spec in specs.items():
        fields = results[name]["fields"]
        assert fields["weight_version"] == spec.weight_version, name
        assert (fields["model_path"], fields["port"]) == (spec.model_path, spec.port), name
    kimi = {
        role: results[f"kimi-k2.5-8gpu {role}"]["fields"] for role in ("extract", "baseline", "speculative")
    }
    assert {f["tp_size"] for f in kimi.values()} == {8}
    assert all(f["trust_remote_code"] for f in kimi.values())
    # Inside the container the server listens on every interface, so the published port reaches it.
    assert {f["host"] for f in kimi.values()} == {"0.0.0.0"}
    for preset, _, _ in PRESETS:
        extract = results[f"{preset} extract"]["fields"]
        assert (
            extract["skip_tokenizer_init"],
            extract["chunked_prefill_size"],
            extract["disable_radix_cache"],
        ) == (
            True,
            -1,
            True,
        ), preset
        spec_fields = results[f"{preset} speculative"]["fields"]
        cfg = load_config(preset, next(o for p, o, _ in PRESETS if p == preset))
        assert spec_fields["speculative_algorithm"] == "EAGLE3"
        assert spec_fields["speculative_num_steps"] == cfg.deploy.num_steps
        assert spec_fields["speculative_eagle_topk"] == cfg.deploy.eagle_topk
        assert spec_fields["speculative_num_draft_tokens"] == (
            cfg.deploy.num_draft_tokens or cfg.deploy.num_steps + 1
        )
        assert Path(spec_fields["speculative_draft_model_path"]).is_dir()
        assert results[f"{preset} baseline"]["fields"]["speculative_algorithm"] is None


def test_a_misspelt_flag_or_a_mistyped_value_is_refused_and_a_retired_one_named(checked) -> None:
    _, results = checked
    assert "unrecognized arguments: --tp-szie 1" in results["misspelt"]["error"]
    assert "argument --max-running-requests: invalid int value: 'many'" in results["mistyped"]["error"]
    # A retired flag is still accepted, and named.
    assert results["retired"]["error"] is None
    assert [n.split()[0] for n in results["retired"]["deprecated"]] == ["'--disable-cuda-graph'"]
