"""Drafter training at long context: peak memory and tokens/s of one optimizer step (EAGLE-3 TTT, AdamW,
clip) whose packed row is one document of 2K, 4K, 8K, 16K and 32K tokens (10% prompt, unsupervised), on
dummy features. Each length runs in its own process, so its peak is its own.

    .venv/bin/python benchmarks/stages/long_context.py                 # CPU, a tiny drafter shape (minutes)
    python benchmarks/stages/long_context.py --device cuda             # GPU, the Kimi-K2.5 drafter shape

Needs torch and aerie only. The shapes: `tiny` (hidden 128, 2 heads of 32 sharing one K/V head, MLP 384,
vocab 2048, draft vocab 1024, TTT 2: exact attention's time is quadratic, and a 32K step must fit a few
minutes of a small CPU) on the CPU; `kimi` (hidden 7168, 64 heads of 128 with one K/V head each,
MLP 12288, vocab 163840, draft vocab 32000, TTT 7: the `kimi-k2.5-8gpu` drafter, unscaled RoPE, which
costs the same) on CUDA. bf16 autocast with compiled flex attention on CUDA, fp32 with the blocked CPU
attention on the CPU; `train.drafter.recompute` (activation checkpointing over the unroll) on unless --no-recompute.

Peak memory: on CUDA `torch.cuda.max_memory_allocated` over the step (model, optimizer state, features
and activations); on the CPU the process's peak resident set (`ru_maxrss`), which also holds Python and
torch themselves, so `step_gib` (the peak less the resident set before the first step) is given beside
it. `peak_ratio_32k_4k` is the growth from 4K to 32K of `peak_gib`; 8 is linear growth.
Writes benchmarks/results/long_context-<hardware>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from aerie.draft.model import DraftConfig, Eagle3Drafter
from aerie.train.config import TrainConfig
from aerie.train.data import Batch
from aerie.train.distributed import DistInfo
from aerie.train.objective import Eagle3Objective
from aerie.train.teaching import Teacher

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository importable
from benchmarks import records  # noqa: E402
from benchmarks.records import hardware_name  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
# What the figures measure: a record is stale once git shows a later commit to these.
CODE_PATHS = [
    "aerie/draft/attention.py",
    "aerie/draft/model.py",
    "aerie/train/objective.py",
    "benchmarks/stages/long_context.py",
]
LENGTHS = (2048, 4096, 8192, 16384, 32768)
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 128, "heads": 2, "kv_heads": 1, "head_dim": 32, "intermediate": 384, "vocab": 2048, "draft_vocab": 1024, "ttt": 2},
    "kimi": {"hidden": 7168, "heads": 64, "kv_heads": 64, "head_dim": 128, "intermediate": 12288, "vocab": 163840, "draft_vocab": 32000, "ttt": 7},
}  # fmt: skip


def draft_config(shape: dict[str, int], max_length: int) -> DraftConfig:
    return DraftConfig(
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        vocab_size=shape["vocab"],
        draft_vocab_size=shape["draft_vocab"],
        rope_theta=50000.0,
        max_position_embeddings=max(max_length, 4096),
    )


def synthetic_row(cfg: DraftConfig, tokens: int, device: str, dtype: torch.dtype) -> tuple[Any, ...]:
    """One document of `tokens` (its first 10% the prompt), random features, the target's head and vocab,
    drawn on `device` (a Kimi-sized embedding and head are 1.2G numbers each)."""
    g = torch.Generator(device).manual_seed(0)
    h, v, vd = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size
    loss_mask = torch.ones(tokens, dtype=torch.bool, device=device)
    loss_mask[: tokens // 10] = False
    batch = Batch(
        input_ids=torch.randint(0, v, (tokens,), generator=g, device=device),
        loss_mask=loss_mask,
        positions=torch.arange(tokens, device=device),
        doc_ids=torch.zeros(tokens, dtype=torch.int32, device=device),
        aux_hidden=torch.randn(tokens, 3 * h, generator=g, device=device).to(dtype),
        last_hidden=torch.randn(tokens, h, generator=g, device=device).to(dtype),
        tokens=tokens,
    )
    embed = (torch.randn(v, h, generator=g, device=device) * 0.02).to(dtype)
    lm_head = torch.randn(v, h, generator=g, device=device) * (4 / h**0.5)  # peaked teacher logits
    used = torch.sort(torch.randperm(v, generator=g, device=device)[:vd]).values
    t2d = torch.zeros(v, dtype=torch.bool, device=device)
    t2d[used] = True
    return batch, embed, lm_head, used, t2d


def one_length(args: argparse.Namespace) -> dict[str, Any]:
    """One length in this process: build, `--steps` timed optimizer steps after `--warmup`, peak memory."""
    shape = SHAPES[args.shape]
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = draft_config(shape, args.one)
    batch, embed, lm_head, used, t2d = synthetic_row(cfg, args.one, args.device, dtype)
    torch.manual_seed(0)
    with torch.device(args.device):  # a billion parameters are initialised where they train
        drafter = Eagle3Drafter(cfg, embed)
    drafter.set_vocab(used - torch.arange(cfg.draft_vocab_size, device=args.device), t2d)
    teacher = Teacher(lm_head, used, t2d, keep_full=False).to(args.device, dtype)
    del lm_head
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=cuda)
    train_cfg = TrainConfig(
        drafter={"family": "eagle3", "ttt_length": shape["ttt"], "recompute": args.recompute},
        batch_tokens=args.one,
        max_length=args.one,
    )
    objective = Eagle3Objective(train_cfg)
    tr = SimpleNamespace(
        cfg=train_cfg, teacher=teacher, device=torch.device(args.device), dtype=dtype,
        attention="flex" if cuda else "dense", dist=DistInfo(),
    )  # fmt: skip

    def step() -> float:
        loss, _ = objective.loss(tr, drafter, batch, lambda x: x)  # type: ignore[arg-type]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    before = _resident_gib()
    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], 0.0
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[len(times) // 2]
    run: dict[str, Any] = {
        "max_length": args.one,
        "tokens_per_s": round(args.one / seconds, 1),
        "seconds_per_step": round(seconds, 3),
        "loss": round(loss, 4),
    }
    if cuda:
        run["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    else:
        peak = _peak_resident_gib()
        run["peak_gib"] = round(peak, 3)
        run["step_gib"] = round(peak - before, 3)
    return run


def _resident_gib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**30


def _peak_resident_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--shape", choices=list(SHAPES), default=None, help="default: tiny (cpu), kimi (cuda)"
    )
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 1 cpu, 2 cuda)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first (default 0 cpu, 1 cuda)"
    )
    parser.add_argument("--no-recompute", dest="recompute", action="store_false")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: one length
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device visible")
    args.shape = args.shape or ("kimi" if cuda else "tiny")
    args.steps = args.steps or (2 if cuda else 1)
    args.warmup = args.warmup if args.warmup is not None else (1 if cuda else 0)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(one_length(args)), flush=True)
        return

    machine = f"{platform.node()} {platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}"
    if cuda:
        machine += f", {torch.cuda.get_device_name()}"
    runs: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        **records.header(CODE_PATHS, machine),
        "complete": False,  # rewritten after every length: a cut-short run keeps its figures
        "shape": {**SHAPES[args.shape], "name": args.shape},
        "precision": "bf16 autocast" if cuda else "fp32",
        "attention": "flex (compiled)" if cuda else "dense, blocked query rows",
        "recompute": args.recompute,
        "cpu_threads": torch.get_num_threads(),
        "peak_source": "torch.cuda.max_memory_allocated" if cuda else "peak resident set (ru_maxrss)",
        "runs": runs,
        "failures": failures,
    }
    out = RESULTS / f"long_context-{hardware_name(args.device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    child = [sys.executable, __file__, "--device", args.device, "--shape", args.shape]
    child += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    child += [] if args.recompute else ["--no-recompute"]
    child += ["--threads", str(args.threads)] if args.threads else []
    for length in (int(x) for x in args.lengths.split(",")):
        proc = subprocess.run([*child, "--one", str(length)], capture_output=True, text=True)
        if proc.returncode == 0:
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), flush=True)
        else:  # out of memory, or anything else: recorded, and the other lengths still measured
            failures.append({"max_length": length, "error": proc.stderr.strip()[-800:]})
            print(json.dumps(failures[-1]), flush=True)
        result["peak_ratio_32k_4k"] = _ratio(runs, "peak_gib")
        if not cuda:
            result["step_ratio_32k_4k"] = _ratio(runs, "step_gib")
        out.write_text(json.dumps(result, indent=2) + "\n")
    result["complete"] = True
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def _ratio(runs: list[dict[str, Any]], key: str) -> float | None:
    by_length = {r["max_length"]: r[key] for r in runs}
    if 4096 not in by_length or 32768 not in by_length or not by_length[4096]:
        return None
    return round(by_length[32768] / by_length[4096], 2)


if __name__ == "__main__":
    main()
