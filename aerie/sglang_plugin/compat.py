"""Which SGLang versions the plugin was written against.

The plugin patches SGLang internals (`LogitsProcessor.forward`, `Scheduler.handle_generate_request`,
the model runner's aux-capture setup, `ForwardBatch` fields), which move between releases. Running on
an untested version could produce a server that answers 200 and writes wrong or no hidden states, so
the launcher refuses it; `AERIE_SGLANG_ALLOW_UNTESTED=1` overrides, and the canary then decides.
"""

from __future__ import annotations

import os
from importlib import metadata

from aerie.errors import ServerLaunchError

SUPPORTED_SGLANG = ("0.5.23",)
ALLOW_UNTESTED_ENV = "AERIE_SGLANG_ALLOW_UNTESTED"

# Every SGLang name the plugin depends on: (module, attribute path). `capture.install` resolves them
# at startup; tests/test_sglang_plugin.py checks them against the pinned release's source.
ATTACH_POINTS = (
    ("sglang.srt.layers.logits_processor", "LogitsProcessor.forward"),
    ("sglang.srt.managers.scheduler", "Scheduler.handle_generate_request"),
    ("sglang.srt.model_executor.model_runner", "configure_aux_hidden_state_capture"),
    ("sglang.srt.distributed.parallel_state", "get_tensor_model_parallel_rank"),
)


def installed_sglang_version() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def check_sglang_version(version: str | None, environ: dict[str, str] | None = None) -> str:
    """Return the version if supported; else raise with what to do."""
    env = os.environ if environ is None else environ
    if version is None:
        raise ServerLaunchError(
            "sglang is not installed in this interpreter: the aerie extraction launcher runs inside "
            "the SGLang image (docker/sglang-extract.Dockerfile)"
        )
    if version in SUPPORTED_SGLANG:
        return version
    if env.get(ALLOW_UNTESTED_ENV) == "1":
        return version
    raise ServerLaunchError(
        f"sglang {version} is not a version the aerie dump plugin was written for "
        f"({', '.join(SUPPORTED_SGLANG)}): it patches SGLang internals that change between releases. "
        f"Use the pinned image (docker/sglang-extract.Dockerfile), or set {ALLOW_UNTESTED_ENV}=1 to try "
        "anyway (the extraction canary then checks the hidden states)"
    )


# Fields SGLang 0.5.23's DeepSeek class reads that transformers' DeepseekV3Config does not write, with
# the values of DeepSeek-V3's own config.json: every layer past `first_k_dense_replace` is MoE, and the
# router is sigmoid-scored with the bias-corrected top-k (the only routing transformers' class runs).
DEEPSEEK_V3_DEFAULTS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def default_config_fields() -> None:
    """Give transformers' DeepseekV3Config the fields SGLang 0.5.23 reads and it does not write
    (`DEEPSEEK_V3_DEFAULTS`). Set as class defaults, so a config.json that has a field keeps its value
    and the user's files are never edited."""
    from transformers import DeepseekV3Config

    for field, value in DEEPSEEK_V3_DEFAULTS.items():
        if not hasattr(DeepseekV3Config, field):
            setattr(DeepseekV3Config, field, value)
