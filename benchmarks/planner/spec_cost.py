"""What one EAGLE-3 round costs against one plain decode step, per target shape and concurrency, in SGLang.

    python3 benchmarks/planner/spec_cost.py run --out DIR [--shapes ...] [--concurrency 1,8,32] [--steps 3,7]
    python3 benchmarks/planner/spec_cost.py record --raw DIR/raw.json [--raw ...] [--date D]
                                       # -> results/spec_cost-<card>.json and aerie/plan/data/spec_cost.json

`run` needs a CUDA GPU and SGLang importable (e.g. the spec-cost job of benchmarks/gpu/job.sh, SGLang's set first on PYTHONPATH). For
every shape it writes the target's config.json and a one-layer EAGLE-3 drafter's (LlamaForCausalLMEagle3,
the target's attention geometry) from the tables below, so nothing is downloaded, and starts SGLang's
offline engine on them with random weights (`load_format="dummy"`, the drafter too): without speculation,
and with `--speculative-algorithm EAGLE3 --speculative-eagle-topk 1` at each step count (a chain of k
drafts verified as k+1 tokens). The engines of one shape start side by side when the card holds them
all; they are measured one at a time, with nothing else on the card.

At each concurrency c, c requests of `--input-len` random token ids decode `--short` and `--long` new
tokens (greedy, `ignore_eos`): the step time is the wall-clock difference over the difference in decode
steps (baseline: new tokens; speculative: the longest request's verify rounds, SGLang's
`spec_verify_ct`), so prefill and the fixed costs of a request cancel. A round's work does not depend on
how many drafts are accepted in its forwards (k draft forwards, one verify of k+1 tokens, one draft
extend padded to k+1 tokens), but acceptance changes what follows a round (the KV cache kept, the
tokens each request gains, when requests finish), so the speculative engines run with SGLang's
simulated acceptance (`SGLANG_SIMULATE_ACC_LEN`, read by sglang/srt/speculative/spec_utils.py at import:
each round accepts that many tokens on average, whatever the random drafter proposed; `--accept-length`,
0 = off). The tokens a round yielded are recorded as `tokens_per_round`. Each (short, long) pair is
repeated `--reps` times (3 by default) and every repetition's time is kept: aerie/plan/served.py fits
its monotone cost model to all of them and takes their spread as its uncertainty.

From the record: break-even acceptance = round time / step time (tokens a round must yield to match
plain decoding), and served speed-up = acceptance length x step time / round time (`aerie/plan/served.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"
PLANNER = Path(__file__).resolve().parents[2] / "aerie" / "plan" / "data" / "spec_cost.json"

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Target shapes, from each model's published config.json (architecture fields only; weights are random).
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "draft_vocab_size": 32768,  # the smollm2-gpu preset's, as served in sglang-h200.json
        "config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "vocab_size": 49152,
            "max_position_embeddings": 8192,
            "rope_theta": 100000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
        },
    },
    "llama-3.2-1b": {
        "model": "meta-llama/Llama-3.2-1B-Instruct",
        "draft_vocab_size": 32000,
        "config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
        },
    },
    "llama-3.1-8b": {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "draft_vocab_size": 32000,
        "config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0},
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    },
    "qwen3-30b-a3b": {
        "model": "Qwen/Qwen3-30B-A3B",
        "draft_vocab_size": 32000,
        "config": {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 151936,
            "max_position_embeddings": 40960,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "tie_word_embeddings": False,
        },
    },
}


def params(cfg: dict[str, Any]) -> tuple[float, float]:
    """(total, active per token) parameters of a shape: embeddings, attention, MLP or experts, head."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    attn = h * hd * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
    emb = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    if "num_experts" in cfg:
        expert = 3 * h * cfg["moe_intermediate_size"]
        router = h * cfg["num_experts"]
        total = emb + layers * (attn + router + cfg["num_experts"] * expert)
        active = emb + layers * (attn + router + cfg["num_experts_per_tok"] * expert)
        return float(total), float(active)
    total = emb + layers * (attn + 3 * h * cfg["intermediate_size"])
    return float(total), float(total)


def target_config(name: str) -> dict[str, Any]:
    cfg = dict(SHAPES[name]["config"])
    cfg.update(hidden_act="silu", torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, use_cache=True)
    return cfg


def drafter_config(name: str) -> dict[str, Any]:
    """The EAGLE-3 drafter SGLang loads for this target: one Llama layer at the target's width and attention
    geometry, the target's dense MLP width, its own draft vocabulary, capture layers as aerie exports them."""
    t = SHAPES[name]["config"]
    layers = t["num_hidden_layers"]
    rope: dict[str, Any] = {"rope_theta": t["rope_theta"], "rope_type": "default"}
    if t.get("rope_scaling"):
        rope.update(t["rope_scaling"])
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": t["hidden_size"],
        "intermediate_size": t["intermediate_size"],
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"],
        "head_dim": t["head_dim"],
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": t["vocab_size"],
        "draft_vocab_size": SHAPES[name]["draft_vocab_size"],
        "max_position_embeddings": t["max_position_embeddings"],
        "rms_norm_eps": t["rms_norm_eps"],
        "rope_theta": t["rope_theta"],
        "rope_scaling": t.get("rope_scaling"),
        "rope_parameters": rope,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [1, layers // 2 - 1, layers - 4],
            "use_aux_hidden_state": True,
        },
    }


def write_configs(root: Path, name: str) -> tuple[Path, Path]:
    target, drafter = root / name / "target", root / name / "drafter"
    for path, cfg in ((target, target_config(name)), (drafter, drafter_config(name))):
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return target, drafter


# ---------------------------------------------------------------- one engine (a child process)


def engine_args(a: argparse.Namespace, target: Path, drafter: Path) -> dict[str, Any]:
    levels = [int(c) for c in a.concurrency.split(",")]
    kw: dict[str, Any] = {
        "model_path": str(target),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "attention_backend": a.attention_backend,
        "mem_fraction_static": a.mem_fraction,
        "max_running_requests": max(levels),
        "max_total_tokens": a.max_total_tokens,
        "context_length": a.context_length,
        "cuda_graph_bs_decode": sorted(set(levels)),
        "disable_radix_cache": True,  # the short and long runs share nothing a cache could serve
        "random_seed": 0,
        "log_level": "warning",
    }
    if a.device == "cpu":  # a smoke run of the harness on SGLang's CPU engine (no speculation there)
        kw.update(device="cpu", attention_backend="torch_native", cuda_graph_backend_decode="disabled")
        kw.update(cuda_graph_backend_prefill="disabled", mem_fraction_static=0.3)
        del kw["cuda_graph_bs_decode"]
    if a.steps:
        kw.update(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=str(drafter),
            speculative_num_steps=a.steps,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=a.steps + 1,
        )
    return kw


def _batch(engine: Any, rng: random.Random, c: int, new: int, input_len: int, vocab: int) -> dict[str, Any]:
    ids = [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(c)]
    sp = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
    t = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=sp)
    wall = time.perf_counter() - t
    meta = [o["meta_info"] for o in outs]
    tokens = [m["completion_tokens"] for m in meta]
    verify = [m.get("spec_verify_ct") or 0 for m in meta]
    return {"new": new, "wall_s": wall, "tokens": tokens, "verify": verify}


def measure(engine: Any, a: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rng = random.Random(0)
    levels = [int(c) for c in a.concurrency.split(",")]
    for c in sorted({1, max(levels)}):  # warm-up: first kernels, allocator
        _batch(engine, rng, c, a.short, a.input_len, vocab)
    out: dict[str, Any] = {}
    for c in levels:
        runs = [
            _batch(engine, rng, c, n, a.input_len, vocab) for _ in range(a.reps) for n in (a.short, a.long)
        ]
        pairs = [(runs[2 * i], runs[2 * i + 1]) for i in range(a.reps)]
        # Each repetition's own step time: its long run against its short one.
        per_rep = [_ms_per_step(a, s_run, l_run) for s_run, l_run in pairs]
        short = min((r for r in runs if r["new"] == a.short), key=lambda r: r["wall_s"])
        long = min((r for r in runs if r["new"] == a.long), key=lambda r: r["wall_s"])
        # Decode steps: plain decoding yields one token a step (the first comes from prefill); a
        # speculative batch runs until its longest request's last verify round.
        if a.steps:
            steps = max(long["verify"]) - max(short["verify"])
        else:
            steps = a.long - a.short
        dt = long["wall_s"] - short["wall_s"]
        level: dict[str, Any] = {
            "concurrency": c,
            "ms_per_step": round(1000 * dt / steps, 4),
            "steps": steps,
            "wall_s": {"short": round(short["wall_s"], 4), "long": round(long["wall_s"], 4)},
            "all_wall_s": [round(r["wall_s"], 4) for r in runs],
            "ms_per_step_reps": [round(x, 4) for x in per_rep if x is not None],
        }
        if a.steps:
            tok, ver = sum(long["tokens"]), sum(long["verify"])
            level["tokens_per_round"] = round(tok / ver, 4) if ver else None
            level["verify_rounds_long"] = [min(long["verify"]), max(long["verify"])]
        out[f"c{c}"] = level
        print(json.dumps({"job": a.label, **level}), flush=True)
    return out


def _ms_per_step(a: argparse.Namespace, short: dict[str, Any], long: dict[str, Any]) -> float | None:
    """One repetition's time per decode step (baseline) or round (speculative); None where the long run
    took no more steps than the short one."""
    steps = max(long["verify"]) - max(short["verify"]) if a.steps else a.long - a.short
    return 1000 * (long["wall_s"] - short["wall_s"]) / steps if steps > 0 else None


SIMULATE_ENV = "SGLANG_SIMULATE_ACC_LEN"


def job(a: argparse.Namespace) -> int:
    target, drafter = Path(a.target), Path(a.drafter)
    state = Path(a.state)
    t0 = time.perf_counter()
    from sglang.srt.entrypoints.engine import Engine

    engine = Engine(**engine_args(a, target, drafter))
    started = time.perf_counter() - t0
    (state / f"{a.label}.ready").write_text(json.dumps({"startup_s": round(started, 1)}))
    go = state / f"{a.label}.go"
    while not go.exists():  # the driver measures one engine at a time
        if (state / "abort").exists():
            engine.shutdown()
            return 2
        time.sleep(0.05)
    vocab = min(json.loads((target / "config.json").read_text())["vocab_size"], 32000)
    simulated = os.environ.get(SIMULATE_ENV)
    result = {
        "startup_s": round(started, 1),
        "simulated_accept_length": float(simulated) if a.steps and simulated else None,
        "levels": measure(engine, a, vocab),
    }
    (state / f"{a.label}.json").write_text(json.dumps(result, indent=2))
    engine.shutdown()
    return 0


# ---------------------------------------------------------------- the driver


def card() -> tuple[str, str, float]:
    import torch

    name = torch.cuda.get_device_name(0)
    mem = torch.cuda.get_device_properties(0).total_memory
    short = "h200" if "H200" in name else "h100" if "H100" in name else name.split()[-1].lower()
    return short, name, mem / 2**30


def job_gib(name: str, steps: int, a: argparse.Namespace) -> float:
    """A generous estimate of one engine's memory: weights, drafter, KV pool, graphs and activations."""
    t = SHAPES[name]["config"]
    total, _ = params(t)
    kv_per_token = 2 * t["num_hidden_layers"] * t["num_key_value_heads"] * t["head_dim"] * 2
    gib = (2 * total + kv_per_token * a.max_total_tokens) / 2**30 + 4.0
    if steps:
        d = drafter_config(name)
        h = d["hidden_size"]
        draft = t["vocab_size"] * h + d["draft_vocab_size"] * h + 3 * h * d["intermediate_size"] + 8 * h * h
        gib += 2 * draft / 2**30 + 1.0
    return gib


def _child_cmd(
    a: argparse.Namespace, name: str, steps: int, target: Path, drafter: Path, state: Path
) -> list[str]:
    label = f"{name}.{'eagle3-k' + str(steps) if steps else 'baseline'}"
    return [
        sys.executable,
        __file__,
        "job",
        "--label",
        label,
        "--target",
        str(target),
        "--drafter",
        str(drafter),
        "--state",
        str(state),
        "--steps",
        str(steps),
        "--mem-fraction",
        str(a.mem_fraction),
        "--device",
        a.device,
        *(
            f"--{k.replace('_', '-')}={getattr(a, k)}"
            for k in (
                "concurrency",
                "input_len",
                "short",
                "long",
                "reps",
                "max_total_tokens",
                "context_length",
                "attention_backend",
            )
        ),
    ]


def _wait(paths: list[Path], procs: list[subprocess.Popen[bytes]], deadline: float) -> None:
    while time.time() < deadline:
        if all(p.exists() or proc.poll() is not None for p, proc in zip(paths, procs, strict=True)):
            return
        time.sleep(0.2)


def run(a: argparse.Namespace) -> int:
    out = Path(a.out)
    state = out / "state"
    state.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    short, device, mem_gib = card()
    raw: dict[str, Any] = {
        "card": short,
        "device": device,
        "device_memory_gib": round(mem_gib, 1),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "settings": {
            k: getattr(a, k)
            for k in (
                "concurrency",
                "steps_list",
                "input_len",
                "short",
                "long",
                "reps",
                "max_total_tokens",
                "accept_length",
            )
        },
        "versions": _versions(),
        "shapes": {},
        "skipped": [],
    }
    steps_list = [0, *(int(s) for s in a.steps_list.split(",") if s)]
    for name in a.shapes.split(","):
        left = a.budget_s - (time.time() - t_start)
        if left < a.min_shape_s:
            raw["skipped"].append({"shape": name, "reason": f"{left:.0f} s of the budget left"})
            continue
        target, drafter = write_configs(out / "models", name)
        total, active = params(SHAPES[name]["config"])
        rec: dict[str, Any] = raw["shapes"].setdefault(
            name,
            {
                "model": SHAPES[name]["model"],
                "architecture": SHAPES[name]["config"]["architectures"][0],
                "params": total,
                "active_params": active,
                "config": SHAPES[name]["config"],
                "drafter": drafter_config(name),
                "modes": {},
            },
        )
        # Engines that fit the card together start side by side; each is then measured alone.
        groups: list[list[int]] = [[]]
        for s in steps_list:
            if groups[-1] and sum(job_gib(name, x, a) for x in [*groups[-1], s]) > 0.8 * mem_gib:
                groups.append([])
            groups[-1].append(s)
        for group in groups:
            _run_group(a, name, group, target, drafter, state, rec, t_start, out)
            (out / "raw.json").write_text(json.dumps(raw, indent=2))
    raw["wall_s"] = round(time.time() - t_start, 1)
    (out / "raw.json").write_text(json.dumps(raw, indent=2))
    _print_table(raw)
    return 0


def _run_group(
    a: argparse.Namespace,
    name: str,
    group: list[int],
    target: Path,
    drafter: Path,
    state: Path,
    rec: dict[str, Any],
    t_start: float,
    out: Path,
) -> None:
    labels = [f"{name}.{'eagle3-k' + str(s) if s else 'baseline'}" for s in group]
    procs = []
    for s, label in zip(group, labels, strict=True):
        log = open(out / f"{label}.log", "wb")  # noqa: SIM115 - the child writes it until it exits
        cmd = _child_cmd(a, name, s, target, drafter, state)
        env = dict(os.environ)
        if s and a.accept_length > 0:  # SGLang reads it when its speculative module is imported
            env[SIMULATE_ENV] = str(min(a.accept_length, s + 1.0))
        procs.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        )
        print(f"started {label}", flush=True)
    deadline = t_start + a.budget_s
    _wait([state / f"{lb}.ready" for lb in labels], procs, min(deadline, time.time() + a.startup_timeout_s))
    for s, label, proc in zip(group, labels, procs, strict=True):
        mode = "baseline" if not s else f"eagle3_k{s}"
        ready = state / f"{label}.ready"
        if not ready.exists():
            rec["modes"][mode] = {"error": "did not start", "log_tail": _tail(out / f"{label}.log")}
            print(f"{label} did not start:\n{rec['modes'][mode]['log_tail']}", flush=True)
            continue
        (state / f"{label}.go").write_text("")
        result = state / f"{label}.json"
        _wait([result], [proc], deadline)
        if result.exists():
            rec["modes"][mode] = json.loads(result.read_text())
            if s:
                rec["modes"][mode]["num_steps"] = s
        else:
            rec["modes"][mode] = {"error": "no result", "log_tail": _tail(out / f"{label}.log")}
            print(f"{label} gave no result:\n{rec['modes'][mode]['log_tail']}", flush=True)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_bytes()[-n:].decode(errors="replace") if path.exists() else ""


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for pkg in ("sglang", "torch", "sglang-kernel", "flashinfer-python", "triton", "transformers"):
        try:
            found[pkg] = version(pkg)
        except PackageNotFoundError:
            found[pkg] = "absent"
    return found


def _print_table(raw: dict[str, Any]) -> None:
    print(
        f"\n{raw['device']}: ms per decode step (baseline) / per EAGLE-3 round, break-even tokens per round"
    )
    for name, rec in raw["shapes"].items():
        base = rec["modes"].get("baseline", {}).get("levels", {})
        for mode, m in rec["modes"].items():
            for key, lvl in m.get("levels", {}).items():
                b = base.get(key, {}).get("ms_per_step")
                ratio = f"  break-even {lvl['ms_per_step'] / b:.2f}" if b and mode != "baseline" else ""
                print(f"  {name:14s} {mode:10s} {key:4s} {lvl['ms_per_step']:8.3f} ms{ratio}")


# ---------------------------------------------------------------- the record


def record(a: argparse.Namespace) -> int:
    """Fold a run's raw.json into results/spec_cost-<card>.json and the planner's table."""
    raws = [json.loads(Path(p).read_text()) for p in a.raw]
    raw = raws[0]
    for more in raws[1:]:  # shapes measured by later runs on the same card (a run per time limit)
        if more["card"] != raw["card"]:
            raise SystemExit(f"{more['card']} != {raw['card']}: one card per record")
        raw["shapes"].update(more["shapes"])
        raw["command"] = f"{raw['command']} ; {more['command']}"
    raw["skipped"] = [s for r in raws for s in r["skipped"] if s["shape"] not in raw["shapes"]]
    shapes: dict[str, Any] = {}
    for name, rec in raw["shapes"].items():
        base = rec["modes"].get("baseline", {}).get("levels")
        if not base:
            continue
        figures: dict[str, Any] = {}
        for key, lvl in base.items():
            row: dict[str, Any] = {"step_ms": lvl["ms_per_step"], "step_ms_reps": lvl.get("ms_per_step_reps")}
            for mode, m in rec["modes"].items():
                if mode == "baseline" or key not in m.get("levels", {}):
                    continue
                k = m["num_steps"]
                r = m["levels"][key]
                row[f"round_ms_k{k}"] = r["ms_per_step"]
                row[f"round_ms_reps_k{k}"] = r.get("ms_per_step_reps")
                row[f"break_even_k{k}"] = round(r["ms_per_step"] / lvl["ms_per_step"], 3)
                row[f"tokens_per_round_k{k}"] = r.get("tokens_per_round")
            figures[key] = row
        shapes[name] = {
            "model": rec["model"],
            "architecture": rec["architecture"],
            "params": rec["params"],
            "active_params": rec["active_params"],
            "moe": "num_experts" in rec["config"],
            "figures": figures,
            "startup_s": {m: v.get("startup_s") for m, v in rec["modes"].items()},
            "errors": {m: v["error"] for m, v in rec["modes"].items() if "error" in v},
        }
    result = {
        "benchmark": "spec_cost",
        "date": a.date or raw["date"],
        "machine": f"one {raw['device']} ({raw['device_memory_gib']} GiB); "
        + ", ".join(f"{k} {v}" for k, v in raw["versions"].items()),
        "command": raw["command"],
        "settings": raw["settings"],
        "figures": shapes,
        "skipped": raw["skipped"],
        "notes": [
            "step_ms: one plain decode step of the whole batch (each running request gains one token); "
            "round_ms_kK: one EAGLE-3 round (topk 1, K drafts, a K+1-token verify, the draft extend) of the "
            "whole batch; both the wall-clock difference between a short and a long generation over the "
            "difference in steps (rounds), so prefill cancels. break_even_kK = round_ms / step_ms: the "
            "acceptance length (tokens per round) at which speculation only matches plain decoding.",
            "Random weights (load_format dummy) for the target and the drafter: the drafts are almost never "
            "accepted (tokens_per_round is what a round yielded), which leaves a round's work unchanged: "
            "K draft forwards and a verify of K+1 tokens run whatever is accepted.",
            "The shapes' config.json files are written by the benchmark from the published architectures "
            "(no download); the drafter is one Llama layer at the target's width, the target's dense MLP "
            "width, draft vocabulary 32,768 (SmolLM2, as served) or 32,000.",
        ],
        "raw": raw,
    }
    result["planner"] = planner_entry(result, raw["card"])
    result["check_against_serve"] = check_against_serve(result)
    if (check := check_line(result["check_against_serve"])) is not None:
        result["planner"]["check"] = check
    path = RESULTS / f"spec_cost-{raw['card']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    table = json.loads(PLANNER.read_text()) if PLANNER.exists() else {"about": PLANNER_ABOUT, "cards": {}}
    table["cards"][raw["card"]] = result["planner"]
    PLANNER.write_text(json.dumps(table, indent=2) + "\n")
    print(f"wrote {path} and {PLANNER}")
    print(json.dumps(result["check_against_serve"], indent=2))
    return 0


PLANNER_ABOUT = (
    "Step and round times of SGLang serving per target shape, card and concurrency (ms), the measurements "
    "aerie/plan/served.py predicts the served speed-up from: each card's entry is the 'planner' section of "
    "benchmarks/results/<source>, written by benchmarks/planner/spec_cost.py record (tests/test_served.py checks "
    "that they agree)."
)


def planner_entry(result: dict[str, Any], card_name: str) -> dict[str, Any]:
    """The record's figures as served.py reads them: per shape, per concurrency, the step and round times."""
    shapes = {}
    for name, rec in result["figures"].items():
        levels = {}
        for key, row in rec["figures"].items():
            rounds = {k.removeprefix("round_ms_k"): v for k, v in row.items() if k.startswith("round_ms_k")}
            reps = {
                k.removeprefix("round_ms_reps_k"): v
                for k, v in row.items()
                if k.startswith("round_ms_reps_k") and v
            }
            if rounds:
                level: dict[str, Any] = {"step_ms": row["step_ms"], "round_ms": rounds}
                if row.get("step_ms_reps"):
                    level["step_ms_reps"] = row["step_ms_reps"]
                if reps:
                    level["round_ms_reps"] = reps
                levels[key.removeprefix("c")] = level
        if levels:
            shapes[name] = {
                "active_params": rec["active_params"],
                "params": rec["params"],
                "moe": rec["moe"],
                "levels": levels,
            }
    settings = result.get("settings", {})
    return {
        "source": f"spec_cost-{card_name}.json",
        "date": result["date"],
        # Where the times hold: the prompt length they were measured at and the acceptance simulated.
        "context": settings.get("input_len"),
        "simulated_accept_length": settings.get("accept_length"),
        "shapes": shapes,
    }


def check_against_serve(result: dict[str, Any]) -> dict[str, Any]:
    """The prediction for SmolLM2-135M at the acceptance length SGLang served, against the speed-up it
    measured (results/sglang-h200.json: aerie's drafter, k=3, served on an H200)."""
    sys.path.insert(0, str(PLANNER.parent.parent.parent.parent))
    from aerie.plan.served import Shape, estimate

    serve = json.loads((RESULTS / "sglang-h200.json").read_text())["serve"]
    entry = result["planner"]
    if "smollm2-135m" not in entry["shapes"]:
        return {"skipped": "smollm2-135m not measured"}
    shape = Shape("smollm2-135m", entry["shapes"]["smollm2-135m"]["active_params"], moe=False)
    levels = [int(k.removeprefix("c")) for k in serve["speedup"]]
    taus = {c: serve["accept_length_by_level"][f"c{c}"] for c in levels}
    est = estimate(shape, "m", 3, levels, taus, table={"cards": {"m": entry}})
    rows = {}
    for p in est.predictions:
        base = serve["baseline"][f"c{p.concurrency}"]
        spec = serve["eagle3"][f"c{p.concurrency}"]
        rows[f"c{p.concurrency}"] = {
            "accept_length_served": p.accept_length,
            "predicted_speedup": round(p.speedup or 0.0, 3),
            "measured_speedup": serve["speedup"][f"c{p.concurrency}"],
            "predicted_step_ms": round(p.step_ms, 3),
            "served_ms_per_token_baseline": round(
                1000 * base["concurrency"] / base["output_tokens_per_s"], 3
            ),
            "predicted_round_ms": round(p.round_ms, 3),
            "served_round_ms": round(
                1000 * spec["concurrency"] * spec["accept_length"] / spec["output_tokens_per_s"], 3
            ),
        }
    return {
        "what": "SmolLM2-135M served by SGLang 0.5.23 with aerie's drafter (k=3, topk 1) on an H200, "
        "benchmarks/results/sglang-h200.json, against served.py's prediction at the served acceptance "
        "length from this record's step and round times. served_*_ms: from the serve's output tokens/s "
        "(wall-clock per level, prefill included)",
        "levels": rows,
    }


def check_line(check: dict[str, Any]) -> str | None:
    """The check against SGLang's serve as the plan prints it beside its predictions."""
    levels = check.get("levels")
    if not levels:
        return None
    at = "/".join(levels)
    predicted = "/".join(f"{row['predicted_speedup']:.2f}x" for row in levels.values())
    measured = "/".join(f"{row['measured_speedup']:.2f}x" for row in levels.values())
    return (
        f"SmolLM2-135M served by SGLang on an H200 with aerie's drafter (k=3) at {at}: predicted "
        f"{predicted}, measured {measured} (benchmarks/results/sglang-h200.json)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--concurrency", default="1,8,32,64")
    common.add_argument("--input-len", type=int, default=128)
    common.add_argument("--short", type=int, default=32, help="new tokens of the short generation")
    common.add_argument("--long", type=int, default=96, help="new tokens of the long generation")
    common.add_argument("--reps", type=int, default=3)
    common.add_argument(
        "--accept-length",
        type=float,
        default=2.5,
        help="SGLang's simulated accept length for the speculative engines (SGLANG_SIMULATE_ACC_LEN; 0 = off)",
    )
    common.add_argument("--max-total-tokens", type=int, default=16384)
    common.add_argument("--context-length", type=int, default=2048)
    common.add_argument("--attention-backend", default="fa3")
    common.add_argument("--mem-fraction", type=float, default=0.88)
    common.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    r = sub.add_parser("run", parents=[common])
    r.add_argument("--out", required=True)
    r.add_argument("--shapes", default=",".join(SHAPES))
    r.add_argument("--steps", dest="steps_list", default="1,3,5,7")
    r.add_argument("--budget-s", type=float, default=540.0)
    r.add_argument("--min-shape-s", type=float, default=60.0)
    r.add_argument("--startup-timeout-s", type=float, default=300.0)
    j = sub.add_parser("job", parents=[common])
    j.add_argument("--label", required=True)
    j.add_argument("--target", required=True)
    j.add_argument("--drafter", required=True)
    j.add_argument("--state", required=True)
    j.add_argument("--steps", type=int, default=0)
    rec = sub.add_parser("record")
    rec.add_argument("--raw", required=True, action="append", help="a run's raw.json (repeat to merge runs)")
    rec.add_argument("--date")
    a = ap.parse_args()
    return {"run": run, "job": job, "record": record}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
