"""The deployment benchmark as the deploy stage runs it, streamed: the target served without and with
EAGLE-3 speculative decoding (the drafter given), the same MT-Bench prompts at each concurrency level,
each request streamed from `/generate` (`aerie.deploy.bench`): TTFT from the first streamed token, ITL
p50/p99 per token, output tokens/s, acceptance length, and the speed-up of the speculative server.

The reference server on this CPU by default; `--backend sglang --device cuda` serves both with SGLang
(`server.launcher` process, SGLang installed) on a GPU.

Writes benchmarks/results/deploy-<hardware>.json ({date, machine, command, figures}).

    .venv/bin/python benchmarks/stages/deploy.py --drafter DIR              # a drafter directory from `make run`
    .venv/bin/python benchmarks/stages/deploy.py                            # an untrained drafter (accepts ~nothing)
    .venv/bin/python benchmarks/stages/deploy.py --backend sglang --device cuda --concurrency 1 8 32 \\
        --prompts 64 --max-new-tokens 256 --drafter DIR
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from aerie.deploy.bench import TTFT_METHOD, benchmark  # noqa: E402
from aerie.deploy.config import DeployConfig  # noqa: E402
from aerie.deploy.work import server_specs  # noqa: E402
from aerie.evaluate.prompts import mtbench_prompts  # noqa: E402
from aerie.serving import ModelServer, ServerConfig  # noqa: E402
from aerie.targets import TargetInfo, resolve_target  # noqa: E402
from benchmarks import records  # noqa: E402
from benchmarks.records import hardware_name  # noqa: E402


def untrained_drafter(target: TargetInfo, out: Path) -> Path:
    """A drafter of random weights (what the pipeline trains from): serving figures, no speed-up."""
    import torch

    from aerie.draft.export import draft_config_for, export_drafter
    from aerie.draft.model import Eagle3Drafter
    from aerie.draft.target_weights import load_embedding

    torch.manual_seed(0)
    drafter = Eagle3Drafter(draft_config_for(target, 512), load_embedding(target)).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.05)
    return export_drafter(drafter, out, target)


def measure(args: argparse.Namespace, target: TargetInfo, drafter_dir: Path) -> dict[str, Any]:
    cfg = DeployConfig(
        concurrency=args.concurrency,
        num_prompts=args.prompts,
        max_new_tokens=args.max_new_tokens,
        num_steps=args.num_steps,
        warmup_requests=args.warmup,
    )
    server = ServerConfig(
        backend=args.backend, launcher="process", device=args.device, port=args.port, startup_timeout_s=900
    )
    prompts = [p.input_ids for p in mtbench_prompts(target.load_tokenizer(), None, 4096)]
    prompts = [prompts[i % len(prompts)] for i in range(cfg.num_prompts)]
    rows: list[dict[str, Any]] = []
    outputs: dict[str, dict[int, list[list[int]]]] = {}
    for name, spec in server_specs(cfg, server, target, str(drafter_dir)).items():
        with ModelServer(spec) as live:
            print(f"{name}: {live.url}", flush=True)
            levels, outputs[name] = benchmark(
                live.url, name, prompts, cfg.concurrency, cfg.max_new_tokens, warmup=cfg.warmup_requests
            )
        rows += [level.to_dict() for level in levels]
    base = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["server"] == "baseline"}
    for r in rows:
        r["speedup"] = (
            round(r["output_tokens_per_s"] / base[r["concurrency"]], 4)
            if base.get(r["concurrency"])
            else None
        )
    same = sum(
        a == b
        for level, outs in outputs["speculative"].items()
        for a, b in zip(outs, outputs["baseline"][level], strict=True)
    )
    return {
        "target": target.name,
        "backend": args.backend,
        "drafter": str(args.drafter) if args.drafter else "untrained (random weights)",
        "num_steps": cfg.num_steps,
        "prompts": cfg.num_prompts,
        "max_new_tokens": cfg.max_new_tokens,
        "ttft_method": TTFT_METHOD,
        "itl_method": "per token: the gap before the streamed chunk that brought it, shared by its tokens",
        "same_outputs": f"{same}/{cfg.num_prompts * len(cfg.concurrency)}",
        "rows": rows,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafter", type=Path, default=None, help="a drafter directory (default: untrained)")
    p.add_argument("--backend", default="reference", choices=["reference", "sglang"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--port", type=int, default=30871)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="default: benchmarks/results/deploy-<hardware>.json")
    args = p.parse_args()
    target = resolve_target(args.target)
    with tempfile.TemporaryDirectory(prefix="aerie-bench-deploy-") as tmp:
        drafter_dir = args.drafter or untrained_drafter(target, Path(tmp) / "drafter")
        figures = measure(args, target, drafter_dir)
    cpus = psutil.cpu_count()
    result = {
        "date": records.now(),
        "machine": f"{platform.machine()} {cpus} CPUs, Python {platform.python_version()}, device {args.device}",
        "command": records.command(),
        "figures": figures,
    }
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"deploy-{hardware_name(args.device)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
