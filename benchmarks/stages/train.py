"""Drafter training throughput: tokens/s and model-FLOPs utilisation of one optimizer step (TTT 7,
AdamW, clip) on synthetic data, for a SmolLM2-sized and a Kimi-K2.5-sized EAGLE-3 drafter, and side by
side with SpecForge's own step (its `OnlineEagle3Model` + `LlamaForCausalLMEagle3`, compact teacher)
when `--specforge-path` points at an unpacked `specforge==0.2.0` wheel (it needs triton + CUDA).

    .venv/bin/python benchmarks/stages/train.py --device cpu
    python benchmarks/stages/train.py --device cuda --specforge-path /tmp/specforge-dl/sf \\
        --batch-tokens 2048,16384,65536

Documents are `--seq-len` tokens (10% prompt, unsupervised), packed `batch_tokens / seq-len` to a row:
aerie's answer to SpecForge's batch size 1 is to pack more tokens per step, so it is measured at several
row sizes; SpecForge runs one sequence of `--seq-len` per step. bf16 autocast on CUDA, fp32 on CPU.
MFU counts the drafter's own training FLOPs (6 x params x tokens x TTT steps + attention); the teacher's
projection is overhead, not model work. On CPU the peak is a measured fp32 GEMM rate, not a datasheet.
Writes benchmarks/results/train-<device>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import torch

from aerie.draft.model import DraftConfig, Eagle3Drafter
from aerie.train.config import TrainConfig
from aerie.train.data import Batch
from aerie.train.distributed import DistInfo
from aerie.train.fused import fused_backend
from aerie.train.objective import Eagle3Objective
from aerie.train.teaching import Teacher

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository importable
from benchmarks.records import hardware_name  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
CONFIGS: dict[str, dict[str, int]] = {
    "smollm2": {"hidden": 576, "heads": 9, "kv_heads": 3, "head_dim": 64, "intermediate": 1536, "vocab": 49152, "draft_vocab": 32000},
    "kimi-k2.5": {"hidden": 7168, "heads": 56, "kv_heads": 8, "head_dim": 128, "intermediate": 18432, "vocab": 163840, "draft_vocab": 32000},
}  # fmt: skip
# Dense bf16 tensor-core peaks (datasheet, no sparsity), by substring of the device name.
GPU_PEAK_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12}


def draft_config(size: dict[str, int]) -> DraftConfig:
    return DraftConfig(
        hidden_size=size["hidden"],
        intermediate_size=size["intermediate"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        head_dim=size["head_dim"],
        vocab_size=size["vocab"],
        draft_vocab_size=size["draft_vocab"],
        rope_theta=100000.0,
        max_position_embeddings=131072,
        aux_layer_ids=(1, 14, 26),
    )


def train_flops(cfg: DraftConfig, tokens: int, seq_len: int, ttt: int) -> float:
    """Forward+backward FLOPs of one step: 6 x matmul params per token per TTT step (fc once), plus
    attention (QK and PV: 4 x heads x head_dim x keys seen, ~seq/2 causal + the k diagonal keys)."""
    h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    layer = (
        2 * h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * cfg.intermediate_size + h * cfg.draft_vocab_size
    )
    fc = 3 * h * h
    attention = sum(4 * nh * hd * ((seq_len + 1) / 2 + k) for k in range(ttt))
    return 3 * tokens * (2 * (fc + ttt * layer) + attention)


def synthetic(cfg: DraftConfig, tokens: int, seq_len: int, device: str, dtype: torch.dtype, seed: int = 0):
    """A packed row of `seq_len`-token documents, the target's head and vocab (all random)."""
    g = torch.Generator().manual_seed(seed)
    h, v, vd = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size
    starts = list(range(0, tokens, seq_len))  # the last document is shorter when seq_len does not divide
    loss_mask = torch.ones(tokens, dtype=torch.bool)
    positions, doc_ids = torch.empty(tokens, dtype=torch.int64), torch.empty(tokens, dtype=torch.int32)
    for d, start in enumerate(starts):
        end = min(start + seq_len, tokens)
        loss_mask[start : start + (end - start) // 10] = False
        positions[start:end] = torch.arange(end - start)
        doc_ids[start:end] = d
    batch = Batch(
        input_ids=torch.randint(0, v, (tokens,), generator=g),
        loss_mask=loss_mask,
        positions=positions,
        doc_ids=doc_ids,
        aux_hidden=torch.randn(tokens, 3 * h, generator=g).to(dtype),
        last_hidden=torch.randn(tokens, h, generator=g).to(dtype),
        tokens=tokens,
    ).to(device, dtype)
    embed = (torch.randn(v, h, generator=g) * 0.02).to(dtype)
    lm_head = torch.randn(v, h, generator=g) * (4 / math.sqrt(h))  # peaked teacher logits
    used = torch.sort(torch.randperm(v, generator=g)[:vd]).values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[used] = True
    return batch, embed, lm_head, used, t2d


def time_steps(step: Any, warmup: int, steps: int, device: str) -> tuple[float, float]:
    """Median seconds per step after `warmup` untimed steps (compiles happen there), and the last loss."""
    loss = 0.0
    for _ in range(warmup):
        loss = step()
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], loss


def aerie_step(name: str, cfg: DraftConfig, tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    batch, embed, lm_head, used, t2d = synthetic(cfg, tokens, args.seq_len, device, dtype)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg, embed).to(device)
    drafter.set_vocab(used - torch.arange(cfg.draft_vocab_size), t2d)
    teacher = Teacher(lm_head, used, t2d, keep_full=False).to(device, dtype)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=device == "cuda")
    attention = args.attention if args.attention != "auto" else ("flex" if device == "cuda" else "dense")
    objective = Eagle3Objective(TrainConfig(drafter={"family": "eagle3", "ttt_length": args.ttt}))
    tr = SimpleNamespace(
        cfg=objective.cfg, teacher=teacher, device=torch.device(device), dtype=dtype,
        attention=attention, dist=DistInfo(),
    )  # fmt: skip

    def step() -> float:
        loss, _ = objective.loss(tr, drafter, batch, lambda x: x)  # type: ignore[arg-type]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds, loss = time_steps(step, args.warmup, args.steps, device)
    if args.profile:
        profile_step(step, f"{name}-{tokens}", args)
    flops = train_flops(cfg, tokens, args.seq_len, args.ttt)
    out = {
        "system": "aerie",
        "config": name,
        "batch_tokens": tokens,
        "attention": attention,
        "seconds_per_step": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1),
        "model_tflops_per_s": round(flops / seconds / 1e12, 3),
        "loss": round(loss, 5),
        # the objective's [T, Vd] kernels: "inductor", "eager" (CPU), or which fell back and why
        "objective_kernels": fused_backend(),
    }
    if device == "cuda":
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def profile_step(step: Any, label: str, args: argparse.Namespace) -> None:
    """One more step under torch.profiler: the ops that take the time, as a table in --profile DIR."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if args.device == "cuda":
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=60)
    path = Path(args.profile) / f"train-profile-{label}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table + "\n")
    print(table, flush=True)


def specforge_step(name: str, cfg: DraftConfig, args: argparse.Namespace) -> dict[str, Any]:
    """SpecForge 0.2.0's training step on the same synthetic data: one sequence of seq_len per step."""
    sys.path.insert(0, args.specforge_path)
    from specforge.algorithms.eagle3.model import OnlineEagle3Model  # type: ignore[import-not-found]
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3  # type: ignore[import-not-found]
    from transformers import LlamaConfig

    device, dtype = args.device, torch.bfloat16
    tokens = args.seq_len
    batch, embed, lm_head, used, t2d = synthetic(cfg, tokens, args.seq_len, device, dtype)
    hf = LlamaConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, draft_vocab_size=cfg.draft_vocab_size,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps, num_hidden_layers=1, pad_token_id=0, hidden_act="silu",
    )  # fmt: skip
    torch.manual_seed(0)
    draft = LlamaForCausalLMEagle3(hf, attention_backend=args.specforge_attention).to(device)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embed)
        draft.t2d.copy_(t2d)
        draft.d2t.copy_(used - torch.arange(cfg.draft_vocab_size))
    draft.embed_tokens.weight.requires_grad_(False)
    model = OnlineEagle3Model(draft, length=args.ttt, attention_backend=args.specforge_attention)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=True)
    head = lm_head.to(device, dtype)
    # SpecForge's data layout (anchors B1): input ids and the teacher's hidden shifted left by one.
    ids = torch.cat([batch.input_ids[1:], batch.input_ids.new_zeros(1)])[None]
    last = torch.cat([batch.last_hidden[1:], batch.last_hidden[:1] * 0])[None]
    loss_mask = batch.loss_mask[None, :, None].to(dtype)
    attention_mask = torch.ones_like(ids, dtype=torch.bool)

    def step() -> float:
        with torch.autocast("cuda", dtype=dtype):
            plosses, *_ = model(
                input_ids=ids, attention_mask=attention_mask, target=None, loss_mask=loss_mask,
                hidden_states=batch.aux_hidden[None], target_hidden_for_compact=last, target_head_weight=head,
            )  # fmt: skip
            loss = sum(0.8**k * p for k, p in enumerate(plosses))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    torch.cuda.reset_peak_memory_stats()
    seconds, loss = time_steps(step, args.warmup, args.steps, device)
    if args.profile:
        profile_step(step, f"{name}-{tokens}", args)
    flops = train_flops(cfg, tokens, args.seq_len, args.ttt)
    out = {
        "system": "specforge-0.2.0",
        "config": name,
        "batch_tokens": tokens,
        "attention": args.specforge_attention,
        "seconds_per_step": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1),
        "model_tflops_per_s": round(flops / seconds / 1e12, 3),
        # SpecForge divides by all B*T positions and drops rows whose target argmax is outside the draft
        # vocab; aerie divides by supervised rows. Same objective, different normaliser.
        "loss": round(loss, 5),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
    return out


def release(device: str) -> None:
    """Free the previous run's model, optimizer and activations before the next one is measured."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def peak_flops(device: str) -> tuple[float, str]:
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, peak in GPU_PEAK_FLOPS.items():
            if key in name:
                return peak, f"{name} dense bf16 datasheet"
        return float("nan"), f"{name}: peak unknown"
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(5):  # best of 5: the least disturbed run on a shared host
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best, f"measured fp32 GEMM {n}^3, best of 5, on {torch.get_num_threads()} threads"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--configs", default=None, help="comma list of " + ", ".join(CONFIGS))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument(
        "--batch-tokens", default=None, help="comma list; default: seq-len (cpu), 2048,16384,65536 (cuda)"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 3 cpu, 10 cuda)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 1 cpu, 3 cuda)")
    parser.add_argument("--attention", choices=["auto", "flex", "dense"], default="auto")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    parser.add_argument(
        "--specforge-path", default=None, help="dir holding an unpacked specforge==0.2.0 wheel"
    )
    parser.add_argument("--specforge-attention", default="flex_attention", choices=["flex_attention", "sdpa"])
    parser.add_argument(
        "--profile", default=None, help="dir: profile one more aerie step per size, op table there"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device visible")
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    configs = args.configs.split(",") if args.configs else (list(CONFIGS) if cuda else ["smollm2"])
    if not cuda and "kimi-k2.5" in configs:
        sys.exit("the Kimi-K2.5-sized drafter is benchmarked on CUDA only")
    sizes = (
        [int(x) for x in args.batch_tokens.split(",")]
        if args.batch_tokens
        else ([2048, 16384, 65536] if cuda else [args.seq_len])
    )
    args.steps = args.steps or (10 if cuda else 3)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)

    peak, peak_source = peak_flops(args.device)
    machine = f"{platform.node()} {platform.machine()} {psutil.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}"
    if cuda:
        machine += f", {torch.cuda.get_device_name()}"
    runs: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "complete": False,  # rewritten after every step measured: a cut-short run keeps its figures
        "figures": {
            "seq_len": args.seq_len,
            "ttt_length": args.ttt,
            "precision": "bf16 autocast" if cuda else "fp32",
            "cpu_threads": torch.get_num_threads(),
            "peak_flops": peak,
            "peak_source": peak_source,
            "runs": runs,
            "failures": failures,
        },
    }
    out = RESULTS / f"train-{hardware_name(args.device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def measure(system: str, name: str, tokens: int, step: Any) -> None:
        """One measurement; a failure (out of memory, a broken peer) is recorded, not fatal."""
        try:
            run = step()
        except Exception as exc:  # noqa: BLE001 - one failed size must not lose the other figures
            failures.append(
                {"system": system, "config": name, "batch_tokens": tokens, "error": repr(exc)[:500]}
            )
            print(json.dumps(failures[-1]), flush=True)
        else:
            run["mfu"] = round(run["model_tflops_per_s"] * 1e12 / peak, 4) if math.isfinite(peak) else None
            runs.append(run)
            print(json.dumps(run), flush=True)
        release(args.device)
        _compare_with_specforge(runs)
        out.write_text(json.dumps(result, indent=2) + "\n")

    for name in configs:
        cfg = draft_config(CONFIGS[name])
        for tokens in sizes:
            measure("aerie", name, tokens, lambda: aerie_step(name, cfg, tokens, args))  # noqa: B023
        if args.specforge_path and not cuda:
            print("SpecForge's step needs triton + CUDA: skipped on cpu", file=sys.stderr)
        elif args.specforge_path:
            measure("specforge-0.2.0", name, args.seq_len, lambda: specforge_step(name, cfg, args))  # noqa: B023
    result["complete"] = True
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def _compare_with_specforge(runs: list[dict[str, Any]]) -> None:
    for sf in (r for r in runs if r["system"] != "aerie"):
        for r in runs:
            if r["config"] == sf["config"] and r["system"] == "aerie":
                r["speedup_vs_specforge"] = round(r["tokens_per_s"] / sf["tokens_per_s"], 2)


if __name__ == "__main__":
    main()
