"""Generation throughput of the reference server's decode backends, in process (no HTTP).

    .venv/bin/python benchmarks/decode.py                                  # CPU, small sizes
    python benchmarks/decode.py --device cuda --concurrency 64,256 --requests-per-slot 3

Continuous batching as the server's scheduler does it: requests wait in a queue, join the running
batch whenever `can_admit` allows (prefill), and leave as soon as they finish; every loop runs one
decoding step. Prompts are random token ids with chat-like lengths; each request asks for a random
number of new tokens (ignore_eos, so lengths do not depend on the weights). Both backends see the same
requests. tokens/s counts generated tokens over the wall time of the whole run (prefills included);
a run that exceeds `--budget-s` stops early and reports what it finished.

Writes benchmarks/results/decode-<device>.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hardware import hardware_name  # noqa: E402

from aerie.engine.generation import BatchedDecoder, GenRequest, SamplingParams  # noqa: E402
from aerie.engine.server import packed  # noqa: E402
from aerie.engine.server.extraction import HiddenStateCapture  # noqa: E402
from aerie.engine.server.loader import load_model  # noqa: E402
from aerie.engine.server.slots import SlotDecoder  # noqa: E402
from aerie.targets import resolve_target  # noqa: E402

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--backends", default="batched,slots", help="from: batched, slots, slots-graphs (CUDA)")
    p.add_argument("--concurrency", default="8", help="comma list of max running requests")
    p.add_argument("--requests-per-slot", type=int, default=2)
    p.add_argument("--prompt-len", default="16,256")
    p.add_argument("--new-tokens", default="16,64")
    p.add_argument("--budget-s", type=float, default=120.0, help="per backend and concurrency")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: a loaded 2-core host thrashes with more)",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    packed.register()
    target = resolve_target("smollm2-135m-instruct")
    loaded = load_model(target.path, args.device, args.dtype, skip_tokenizer=True)
    attention = HiddenStateCapture(loaded.model, (2,), loaded.device).choose_attention()
    lo_p, hi_p = map(int, args.prompt_len.split(","))
    lo_n, hi_n = map(int, args.new_tokens.split(","))
    machine = f"{platform.node()} {platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}"
    if args.device == "cuda":
        machine += f", {torch.cuda.get_device_name()}"
    runs: list[dict[str, Any]] = []
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "command": " ".join(["python", *sys.argv]),
        "complete": False,  # rewritten after every run: a run cut short by a timeout keeps what it measured
        "figures": {
            "model": "SmolLM2-135M-Instruct",
            "dtype": str(loaded.dtype).removeprefix("torch."),
            "packed_prefill_attention": attention,
            "attention_fallback_reason": packed.backend_reason(),
            "prompt_len": [lo_p, hi_p],
            "new_tokens": [lo_n, hi_n],
            "runs": runs,
        },
    }
    out = ROOT / "benchmarks" / "results" / f"decode-{hardware_name(args.device)}.json"
    for concurrency in map(int, args.concurrency.split(",")):
        requests = make_requests(
            concurrency * args.requests_per_slot, loaded.vocab_size, (lo_p, hi_p), (lo_n, hi_n)
        )
        for name in args.backends.split(","):
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
