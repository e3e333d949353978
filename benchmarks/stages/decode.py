"""Generation throughput of the reference server's decode backends, in process (no HTTP).

    .venv/bin/python benchmarks/stages/decode.py                                  # CPU, small sizes
    python benchmarks/stages/decode.py --device cuda --concurrency 64,256 --requests-per-slot 3
    python benchmarks/stages/decode.py --device cuda --backends slots-graphs --concurrency 256 \
        --shapes 16,256:64,384 256,2048:200,384 --record decode_context     # rate against context length

Continuous batching as the server's scheduler does it: requests wait in a queue, join the running
batch whenever `can_admit` allows (prefill), and leave as soon as they finish; every loop runs one
decoding step. Prompts are random token ids with chat-like lengths; each request asks for a random
number of new tokens (ignore_eos, so lengths do not depend on the weights). Both backends see the same
requests. tokens/s counts generated tokens over the wall time of the whole run (prefills included);
a run that exceeds `--budget-s` stops early and reports what it finished.

Each `--shapes` entry (`PROMPT_LO,PROMPT_HI:NEW_LO,NEW_HI`, default `--prompt-len:--new-tokens`) is run at
every concurrency and backend; a run records its requests' mean prompt and new tokens and their mean
context, the cache length the average generated token is decoded against (its prompt plus the tokens
before it), since every decoding step reads the K/V of that many positions per row.

Writes benchmarks/results/<record>-<device>.json (`--record`, default decode), or `--out`.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from aerie.engine.generation import BatchedDecoder, GenRequest, SamplingParams  # noqa: E402
from aerie.engine.server import packed  # noqa: E402
from aerie.engine.server.extraction import HiddenStateCapture  # noqa: E402
from aerie.engine.server.loader import (  # noqa: E402
    LoadedModel,
    load_model,
    resolve_device,
    resolve_dtype,
)
from aerie.engine.server.slots import SlotDecoder  # noqa: E402
from aerie.targets import avoid_cudnn_attention, resolve_target  # noqa: E402
from benchmarks import records  # noqa: E402
from benchmarks.records import hardware_name  # noqa: E402

BACKENDS: dict[str, tuple[type[BatchedDecoder], dict[str, Any]]] = {
    "batched": (BatchedDecoder, {}),
    "slots": (SlotDecoder, {}),
    "slots-graphs": (SlotDecoder, {"graphs": "cuda"}),  # CUDA only
}


def make_requests(
    n: int, vocab: int, prompt_len: tuple[int, int], new_tokens: tuple[int, int]
) -> list[GenRequest]:
    rng = random.Random(0)
    return [
        GenRequest(
            f"r{i}",
            [rng.randrange(100, vocab) for _ in range(rng.randint(*prompt_len))],
            SamplingParams(max_new_tokens=rng.randint(*new_tokens), temperature=0.0, ignore_eos=True),
        )
        for i in range(n)
    ]


def parse_range(text: str, what: str) -> tuple[int, int]:
    try:
        lo, hi = map(int, text.split(","))
    except ValueError:
        raise SystemExit(f"decode.py: {what} {text!r} is not LO,HI (two integers)") from None
    if not 0 < lo <= hi:
        raise SystemExit(f"decode.py: {what} {text!r} needs 0 < LO <= HI")
    return lo, hi


def parse_shape(text: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """`PROMPT_LO,PROMPT_HI:NEW_LO,NEW_HI` -> the prompt-length and new-token ranges."""
    prompt, sep, new = text.partition(":")
    if not sep:
        raise SystemExit(f"decode.py: shape {text!r} is not PROMPT_LO,PROMPT_HI:NEW_LO,NEW_HI")
    return parse_range(prompt, "prompt range"), parse_range(new, "new-token range")


def length_figures(requests: list[GenRequest]) -> dict[str, float]:
    """Mean prompt and new tokens, and the mean context of a generated token: the i-th of n new tokens
    (i = 1..n) is decoded against prompt + i positions, so a request contributes n * (prompt + (n+1)/2)."""
    new = [r.params.max_new_tokens for r in requests]
    prompts = [len(r.input_ids) for r in requests]
    weighted = sum(n * (p + (n + 1) / 2) for p, n in zip(prompts, new, strict=True))
    return {
        "mean_prompt_tokens": round(sum(prompts) / len(requests), 1),
        "mean_new_tokens": round(sum(new) / len(requests), 1),
        "mean_context": round(weighted / sum(new), 1),
    }


def drive(
    decoder: BatchedDecoder, requests: list[GenRequest], budget_s: float, device: str
) -> dict[str, Any]:
    waiting = collections.deque(requests)
    finished_tokens = steps = finished = running_sum = 0
    began = time.perf_counter()
    with torch.inference_mode():
        while waiting or decoder.num_running:
            taken: list[GenRequest] = []
            tokens = 0
            while waiting and decoder.can_admit(waiting[0], len(taken), tokens):
                taken.append(waiting.popleft())
                tokens += len(taken[-1].input_ids)
            done = decoder.admit(taken)
            running_sum += decoder.num_running
            done += decoder.step()
            steps += 1
            finished += len(done)
            finished_tokens += sum(len(r.output_ids) for r in done)
            if time.perf_counter() - began > budget_s:
                break
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - began
    generated = finished_tokens + sum(len(row.output_ids) for row in decoder.rows)
    return {
        "requests_finished": finished,
        "requests_total": len(requests),
        "generated_tokens": generated,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(generated / wall, 1),
        "steps_per_s": round(steps / wall, 1),
        "mean_running": round(running_sum / max(steps, 1), 1),
        "stopped_by_budget": finished < len(requests),
    }


def random_model(config_dir: str, device: str, dtype: str) -> LoadedModel:
    """The target's architecture from its config.json, randomly initialized: a decoding step does the same
    work whatever the weights (greedy, ignore_eos, fixed lengths), so speed needs only the shapes, and a
    host that lacks the checkpoint measures it from a few KB of config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    avoid_cudnn_attention(dev)
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation="sdpa")
    model.eval()
    eos = config.eos_token_id
    return LoadedModel(
        model=model,
        tokenizer=None,
        device=dev,
        dtype=torch_dtype,
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        vocab_size=int(model.get_input_embeddings().weight.shape[0]),
        context_len=int(config.max_position_embeddings),
        eos_token_ids=list(eos) if isinstance(eos, list) else [int(eos)],
        architecture=str(config.architectures[0]),
        model_type=str(config.model_type),
        load_seconds=0.0,
    )


def single_shape(shapes: list[tuple[tuple[int, int], tuple[int, int]]]) -> dict[str, list[int]]:
    """One shape: its ranges once for the whole record (the layout of the records before `--shapes`);
    several: each run carries its own."""
    if len(shapes) > 1:
        return {}
    ((prompt_len, new_tokens),) = shapes
    return {"prompt_len": list(prompt_len), "new_tokens": list(new_tokens)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--backends", default="batched,slots", help="from: batched, slots, slots-graphs (CUDA)")
    p.add_argument("--concurrency", default="8", help="comma list of max running requests")
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--prompt-len", default="16,256")
    p.add_argument("--new-tokens", default="16,64")
    p.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        help="PROMPT_LO,PROMPT_HI:NEW_LO,NEW_HI ... (default: --prompt-len:--new-tokens)",
    )
    p.add_argument(
        "--record", default="decode", help="results file: benchmarks/results/RECORD-<hardware>.json"
    )
    p.add_argument("--out", default=None, help="results file (default: the --record one)")
    p.add_argument(
        "--target-config",
        default=None,
        help="a directory with the target's config.json: random weights of its shapes instead of the checkpoint",
    )
    p.add_argument("--budget-s", type=float, default=120.0, help="per backend and concurrency")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: a loaded 2-core host thrashes with more)",
    )
    args = p.parse_args()
    shapes = [parse_shape(s) for s in args.shapes or [f"{args.prompt_len}:{args.new_tokens}"]]
    torch.set_num_threads(args.threads)
    packed.register()
    if args.target_config:
        loaded = random_model(args.target_config, args.device, args.dtype)
    else:
        target = resolve_target("smollm2-135m-instruct")
        loaded = load_model(target.path, args.device, args.dtype, skip_tokenizer=True)
    attention = HiddenStateCapture(loaded.model, (2,), loaded.device).choose_attention()
    machine = f"{platform.node()} {platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}"
    if args.device == "cuda":
        machine += f", {torch.cuda.get_device_name()}"
    runs: list[dict[str, Any]] = []
    result = {
        "date": records.now(),
        "machine": machine,
        "command": records.command(),
        "complete": False,  # rewritten after every run: a run cut short by a timeout keeps what it measured
        "figures": {
            "model": "SmolLM2-135M-Instruct",
            "weights": f"random, from {args.target_config}/config.json"
            if args.target_config
            else "the checkpoint",
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "packed_prefill_attention": attention,
            "attention_fallback_reason": packed.backend_reason(),
            **single_shape(shapes),
            "runs": runs,
        },
    }
    out = (
        Path(args.out)
        if args.out
        else ROOT / "benchmarks" / "results" / f"{args.record}-{hardware_name(args.device)}.json"
    )
    cases = [(shape, c) for shape in shapes for c in map(int, args.concurrency.split(","))]
    # Backend by backend: a run cut short by a timeout has every shape of the first backends.
    for name, ((prompt_len, new_tokens), concurrency) in (
        (b, case) for b in args.backends.split(",") for case in cases
    ):
        requests = make_requests(
            concurrency * args.requests_per_slot, loaded.vocab_size, prompt_len, new_tokens
        )
        lengths = {"prompt_len": list(prompt_len), "new_tokens": list(new_tokens), **length_figures(requests)}
        cls, extra = BACKENDS[name]
        decoder = cls(
            loaded.model,
            None,
            eos_token_ids=loaded.eos_token_ids,
            device=loaded.device,
            max_running=concurrency,
            max_prefill_tokens=65536,
            seed=0,
            **extra,
        )
        warm = requests[: max(2, concurrency // 4)]
        drive(decoder, warm, min(30.0, args.budget_s), loaded.device)
        run = {
            "backend": name,
            "concurrency": concurrency,
            **lengths,
            **drive(decoder, requests, args.budget_s, loaded.device),
        }
        graphs = getattr(decoder, "graphs", None)
        if graphs is not None and graphs.capture:
            run["graphs_captured"], run["graphs_disabled"] = len(graphs.graphs), graphs.disabled
        print(json.dumps(run), flush=True)
        runs.append(run)
        out.write_text(json.dumps(result, indent=2) + "\n")
        del decoder
        if args.device == "cuda":
            torch.cuda.empty_cache()
    result["complete"] = True
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
