"""Run by vLLM's own interpreter (not aerie's): serve a target with and without an exported drafter in
vLLM's offline engine on the CPU, greedily, and report what vLLM built and generated.

    python vllm_drafter_run.py REQUEST.json OUT_DIR

REQUEST.json: {"target": the target's directory, "drafter": the drafter's vllm/ folder,
"num_speculative_tokens": K, "prompts": [[token ids], ...], "max_tokens": N}.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the drafter vLLM loaded is
read straight from its model runner: OUT_DIR/drafter.safetensors holds every parameter of vLLM's drafter
module as loaded (a linear layer's weight as it was before vLLM's CPU kernels packed it: on a CPU with
AVX-512 BF16 or oneDNN they replace it with an empty tensor), and OUT_DIR/result.json its class, config fields, the target layers vLLM captures, and
the greedy token ids of both runs with the speculative run's acceptance counters. A stage that fails
writes its error to result.json (`error`, `stage`) and exits 0, so the test reports vLLM's own words.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


LOADED = "_loaded_weight"


def keep_loaded_weights() -> None:
    """Before vLLM's CPU GEMM dispatch packs a linear layer's weight (and may drop it), keep a copy of the
    weight as loaded on the layer. Its callers import it at each call, so replacing the module's
    function reaches them."""
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm

    def keeping(layer: Any, remove_weight: bool) -> None:
        if not layer.weight.is_meta:
            setattr(layer, LOADED, layer.weight.detach().clone())
        dispatch(layer, remove_weight)

    utils.dispatch_cpu_unquantized_gemm = keeping


def engine(target: str, speculative: dict[str, Any] | None) -> Any:
    from vllm import LLM

    return LLM(
        model=target,
        speculative_config=speculative,
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=4,
        dtype="bfloat16",
        seed=0,
        disable_log_stats=False,  # the speculative counters are statistics
        skip_tokenizer_init=True,  # token ids in and out: a test target may ship no tokenizer
    )


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def model_runner(llm: Any) -> Any:
    """The in-process engine core's model runner (the one worker of a CPU engine)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


def drafter_facts(runner: Any, out: Path) -> dict[str, Any]:
    """What vLLM built for the drafter: its class, config and parameters (saved to drafter.safetensors)."""
    from safetensors.torch import save_file

    model = runner.drafter.model
    cfg = model.config
    params = {name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters()}
    for prefix, module in model.named_modules():
        if hasattr(module, LOADED):
            params[f"{prefix}.weight"] = getattr(module, LOADED).to("cpu").contiguous()
    save_file(params, str(out / "drafter.safetensors"))
    target_model = runner.model
    holder = getattr(target_model, "model", target_model)
    return {
        "class": type(model).__name__,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": getattr(cfg, "norm_before_residual", None),
        "num_aux_hidden_states": model.model.num_aux_hidden_states,
        "fc_input_size": model.model.fc_input_size,
        "target_capture_layers": sorted(getattr(holder, "aux_hidden_state_layers", ())),
        "method": runner.speculative_config.method,
        "num_speculative_tokens": runner.speculative_config.num_speculative_tokens,
    }


def spec_counters(llm: Any) -> dict[str, int]:
    """vLLM's speculative counters (drafts, draft tokens, accepted tokens) after the run."""
    counters: dict[str, int] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            counters[metric.name.removeprefix("vllm:spec_decode_")] = int(metric.value)
    return counters


def main(request_file: str, out_dir: str) -> None:
    req = json.loads(Path(request_file).read_text())
    out = Path(out_dir)
    result: dict[str, Any] = {}
    stage = "baseline"
    keep_loaded_weights()
    try:
        llm = engine(req["target"], None)
        result["baseline"] = generate(llm, req["prompts"], req["max_tokens"])
        del llm
        gc.collect()
        stage = "load"
        speculative = {
            "method": "eagle3",
            "model": req["drafter"],
            "num_speculative_tokens": req["num_speculative_tokens"],
        }
        llm = engine(req["target"], speculative)
        result["drafter"] = drafter_facts(model_runner(llm), out)
        stage = "speculative"
        result["speculative"] = generate(llm, req["prompts"], req["max_tokens"])
        result["counters"] = spec_counters(llm)
    except Exception as exc:  # noqa: BLE001 - reported to the test with vLLM's own message
        result["stage"] = stage
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-6000:]
    (out / "result.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
