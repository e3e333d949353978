"""Speculative decoding speed on MT-Bench first turns: the target's greedy decoding against the same
decoder with prompt lookup and (given `--drafter DIR`) an EAGLE-3 drafter, at each `--steps`.

    .venv/bin/python benchmarks/stages/spec_decode.py --device cpu --prompts 8 --max-new-tokens 64
    python benchmarks/stages/spec_decode.py --device cuda --prompts 80 --max-new-tokens 256 \\
        --drafter artifacts/smollm2-gpu/train/<key>/drafter

Every configuration decodes the same prompts with `aerie.engine.speculative.decoder.SpecDecoder` (batch
`--batch-size`, default 1: the latency setting where speculation pays). The baseline is the same
decoder with no proposer (one target forward per token), so the speed-up measures speculation, not
implementation differences; `transformers`' own `generate()` is timed too, for scale. Outputs are
compared to the baseline's token by token (lossless: all identical in fp32; bf16 may differ on
near-ties between verify and decode shapes). Writes benchmarks/results/spec_decode-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
import torch

from aerie.engine.speculative.decoder import NoProposer, Proposer, SpecDecoder, SpecStats, greedy_reference
from aerie.engine.speculative.prompt_lookup import PromptLookupProposer
from aerie.evaluate.prompts import mtbench_prompts
from aerie.targets import resolve_dtype, resolve_target

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository importable
from benchmarks.records import hardware_name  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _decode(
    model: Any,
    make: Any,
    prompts: list[list[int]],
    steps: int,
    max_new: int,
    batch: int,
    eos: list[int],
    aux_layers: list[int] | None,
    device: str,
) -> tuple[SpecStats, list[list[int]]]:
    stats = SpecStats(steps)
    outputs: list[list[int]] = []
    _sync(device)
    started = time.perf_counter()
    for i in range(0, len(prompts), batch):
        decoder = SpecDecoder(model, make(), num_steps=steps, eos_token_ids=eos, aux_layers=aux_layers)
        for out in decoder.generate(prompts[i : i + batch], max_new):
            stats.add(out)
            outputs.append(out.output_ids)
    _sync(device)
    stats.seconds = time.perf_counter() - started
    return stats, outputs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument(
        "--drafter",
        default=None,
        help="An exported EAGLE-3 drafter directory (config.json + model.safetensors).",
    )
    p.add_argument("--prompts", type=int, default=8, help="MT-Bench questions (first turns), at most 80.")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, nargs="+", default=[3, 7])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a shared host)."
    )
    p.add_argument("--skip-hf", action="store_true", help="Do not time transformers' generate().")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    target = resolve_target(args.target)
    dtype = resolve_dtype(args.dtype, args.device)
    model = target.load_model(args.device, str(dtype).removeprefix("torch."))
    prompts = [q.input_ids for q in mtbench_prompts(target.load_tokenizer(), args.prompts, 4096)]
    eos = target.eos_token_ids

    # Warm-up: allocator, kernels, CUDA context.
    SpecDecoder(model, NoProposer(), num_steps=0, eos_token_ids=eos).generate(prompts[:1], 8)

    rows: list[dict[str, Any]] = []
    base_stats, base_out = _decode(
        model, NoProposer, prompts, 0, args.max_new_tokens, args.batch_size, eos, None, args.device
    )
    rows.append({"proposer": "none (greedy)", **_row(base_stats, base_stats, base_out, base_out)})
    print(f"greedy: {base_stats.tokens_per_second:.1f} tok/s", flush=True)

    if not args.skip_hf:
        _sync(args.device)
        started = time.perf_counter()
        hf_tokens = sum(len(greedy_reference(model, q, args.max_new_tokens, eos)) for q in prompts)
        _sync(args.device)
        hf_seconds = time.perf_counter() - started
        rows.append(
            {"proposer": "transformers generate()", "tokens_per_second": round(hf_tokens / hf_seconds, 2)}
        )

    proposers: list[tuple[str, Any, list[int] | None]] = [("prompt_lookup", PromptLookupProposer, None)]
    if args.drafter:
        from aerie.draft.export import load_drafter
        from aerie.engine.speculative.eagle import EagleProposer

        drafter = load_drafter(args.drafter, target, device=args.device, dtype=dtype)
        eagle_layers = EagleProposer(drafter).aux_layers

        def make_eagle() -> Proposer:
            return EagleProposer(drafter)

        proposers.append(("eagle3", make_eagle, eagle_layers))
    for name, make, layers in proposers:
        for k in args.steps:
            stats, out = _decode(
                model, make, prompts, k, args.max_new_tokens, args.batch_size, eos, layers, args.device
            )
            rows.append({"proposer": name, **_row(stats, base_stats, out, base_out)})
            print(
                f"{name} k={k}: {stats.tokens_per_second:.1f} tok/s, accept length {stats.accept_length:.3f}",
                flush=True,
            )

    machine = f"{platform.node()} {platform.machine()} {psutil.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}"
    if args.device.startswith("cuda"):
        machine += f", {torch.cuda.get_device_name()}"
    device_tag = "cuda" if args.device.startswith("cuda") else "cpu"
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "command": "python benchmarks/stages/spec_decode.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "figures": {
            "target": target.name,
            "dtype": str(dtype).removeprefix("torch."),
            "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "batch_size": args.batch_size,
            "threads": args.threads,
            "drafter": args.drafter,
            "rows": rows,
        },
    }
    out_path = Path(args.out) if args.out else RESULTS / f"spec_decode-{hardware_name(device_tag)}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["figures"], indent=2))
    return 0


def _row(
    stats: SpecStats, base: SpecStats, outputs: list[list[int]], base_outputs: list[list[int]]
) -> dict[str, Any]:
    d = stats.to_dict()
    return {
        "num_steps": stats.num_steps,
        "tokens_per_second": d["tokens_per_second"],
        "speedup": round(stats.tokens_per_second / base.tokens_per_second, 3)
        if base.tokens_per_second
        else None,
        "accept_length": d["accept_length"],
        "spec_accept_length": d["spec_accept_length"],
        "conditional_acceptance": d["conditional_acceptance"],
        "completion_tokens": stats.completion_tokens,
        "seconds": d["seconds"],
        "identical_to_greedy": sum(a == b for a, b in zip(outputs, base_outputs, strict=True)),
    }


if __name__ == "__main__":
    sys.exit(main())
