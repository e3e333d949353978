"""A real CUDA out-of-memory in the reference server's decoding step, with CUDA graphs on: the server must
recover (no graph left on freed memory, no "illegal memory access"), stay healthy and answer correctly.

    python benchmarks/gpu/gpu_oom_fault.py [--model PATH] [--out benchmarks/results/gpu_oom_fault-<card>.json]

What it does, on one GPU:

1. launches the reference server (`ModelServer`, `--cuda-graphs`) with a batch and a KV cache given by
   hand (`--max-running-requests`, `--max-total-tokens`: a user's setting wins over the sizing from
   free memory) that are 1.1 times the card at the long prompt's length: the first graph step of a
   long request must allocate more K/V than the card holds, as the `smollm2-gpu` preset tuned on an
   H200 did on an H100;
2. a short greedy request (the reference answer), then the long request (the allocation fails for real,
   in `KVSlots.ensure` under `DecodeGraphs.logits`), then the short request again;
3. checks: the long request answered 200, the short answer equals the reference, `/health_generate`
   is 200, `/server_info` counts the recoveries and shows the lowered batch, and the server log has the
   out-of-memory recovery and no illegal memory access.

Writes {date, machine, command, figures, checks}; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from aerie.serving import ModelServer, ServerConfig, spec_for  # noqa: E402
from benchmarks import records  # noqa: E402
from benchmarks.records import hardware_name  # noqa: E402
from tests.processes import free_port  # noqa: E402

LONG_PROMPT = 7000  # tokens: its row grows to 7,168 positions
SHORT = "The capital of France is"


def _cell_bytes(model: Path) -> tuple[int, int]:
    """Bytes of one K/V cell in bfloat16, and the context, from the model's config.json."""
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * heads * head_dim * 2, int(cfg["max_position_embeddings"])


def _generate(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=600)


def run(model: Path, work: Path) -> dict[str, Any]:
    import torch

    cell, context = _cell_bytes(model)
    _, total = torch.cuda.mem_get_info()
    positions = -(-context // 256) * 256
    rows = math.ceil(1.1 * total / (7168 * cell))
    extra = [
        "--cuda-graphs",
        "--max-running-requests",
        str(rows),
        "--max-total-tokens",
        str(rows * positions),
    ]
    cfg = ServerConfig(port=free_port(), device="cuda", extra_args=extra, grace_s=30.0)
    spec = spec_for(cfg, model_path=str(model), name="oom-fault", log_path=work / "server.log")
    short = {"text": SHORT, "sampling_params": {"temperature": 0, "max_new_tokens": 16}}
    long: dict[str, Any] = {
        "input_ids": [(i * 7919) % 20000 + 100 for i in range(LONG_PROMPT)],
        "sampling_params": {"temperature": 0, "max_new_tokens": 16},
    }
    with ModelServer(spec) as server:
        reference = _generate(server.url, short)
        began = time.monotonic()
        long_reply = _generate(server.url, long)
        long_s = time.monotonic() - began
        again = _generate(server.url, short)
        health = httpx.get(f"{server.url}/health_generate", timeout=60).status_code
        info = httpx.get(f"{server.url}/server_info", timeout=30).json()
    log = spec.log_path.read_text(errors="replace")
    state = info["internal_states"][0]
    checks = {
        "long_request_answered": long_reply.status_code == 200,
        "short_answer_unchanged": reference.status_code == again.status_code == 200
        and reference.json()["output_ids"] == again.json()["output_ids"],
        "health_generate_200": health == 200,
        "oom_happened_and_recovered": state["oom_recoveries"] >= 1
        and "Out of memory in a generation step" in log,
        "no_illegal_memory_access": "illegal memory access" not in log,
        "not_unhealthy": info.get("unhealthy") is None,
    }
    figures = {
        "card_memory_gb": round(total / 2**30, 2),
        "cell_bytes": cell,
        "asked_running_requests": rows,
        "asked_cells": rows * positions,
        "oom_recoveries": state["oom_recoveries"],
        "failures": state["failures"],
        "long_request_s": round(long_s, 2),
        "long_request_status": long_reply.status_code,
        "kv_plan_lines": [
            line.strip() for line in log.splitlines() if "KV cache" in line and "lowered" in line
        ],
    }
    return {"figures": figures, "checks": checks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="an HF model directory (default: SmolLM2-135M)"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/aerie-gpu-oom-fault"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.model is None:
        from aerie.targets import resolve_target

        args.model = Path(resolve_target("smollm2-135m-instruct").path)
    card = hardware_name("cuda")
    out = args.out or ROOT / "benchmarks" / "results" / f"gpu_oom_fault-{card}.json"
    args.work_dir.mkdir(parents=True, exist_ok=True)
    result = run(args.model, args.work_dir)
    import torch

    record = {
        "date": records.now(),
        "machine": f"{torch.cuda.get_device_name(0)}, {platform.node()}",
        "command": records.command(),
        **result,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    sys.exit(0 if all(result["checks"].values()) else 1)


if __name__ == "__main__":
    main()
