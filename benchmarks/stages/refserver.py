"""Reference-server throughput: packed extraction vs padded vs one-at-a-time, and batched generation.

In process (same model, same sequences, same run):
  - packed:  the server's extraction forward (one row, segment-causal attention, capture hooks)
  - padded:  length-sorted, right-padded batches with a padding mask (the usual HF batching)
  - single:  one sequence per forward (the peers' offline style, before any file writing)
Over HTTP against a real `python -m aerie.engine` process:
  - extract: /generate prefill-only requests (many sequences each, 2 in flight) incl. dump writes
  - chat:    /v1/chat/completions, 1 request at a time vs N concurrent (the batching loop)

Writes benchmarks/results/refserver-cpu.json ({date, machine, command, figures}).

    .venv/bin/python benchmarks/stages/refserver.py                 # CPU, small sizes
    .venv/bin/python benchmarks/stages/refserver.py --device cuda --samples 2048 --max-len 2048 --batch-tokens 65536
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from aerie.engine.server import packed  # noqa: E402
from aerie.engine.server.extraction import HiddenStateCapture  # noqa: E402
from aerie.engine.server.loader import load_model  # noqa: E402
from aerie.targets import resolve_target  # noqa: E402
from benchmarks import records  # noqa: E402

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three prime numbers.",
    "Give me a tip for learning Python.",
    "What is a neural network?",
    "Describe a sunset in two sentences.",
    "Why is the sky blue?",
]


def _lengths(n: int, max_len: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    # Mixed lengths, skewed short like chat corpora: uniform in log space between 16 and max_len.
    logs = torch.empty(n).uniform_(
        torch.log(torch.tensor(16.0)).item(), torch.log(torch.tensor(float(max_len))).item(), generator=g
    )
    return [int(x) for x in logs.exp().round().tolist()]


def _sequences(n: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (t,), generator=g).tolist() for t in _lengths(n, max_len, seed)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_packed(capture: HiddenStateCapture, seqs: list[list[int]], budget: int, device: str) -> float:
    plan = packed.plan_packs([len(s) for s in seqs], budget)
    start = time.perf_counter()
    for idx in plan:
        capture.capture([seqs[i] for i in idx])
    _sync(device)
    return time.perf_counter() - start


def bench_padded(capture: HiddenStateCapture, seqs: list[list[int]], budget: int, device: str) -> float:
    """Length-sorted batches padded to their longest member, B * max_len <= budget."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * len(seqs[i]) > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    start = time.perf_counter()
    for batch in batches:
        width = max(len(seqs[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
            mask[row, : len(seqs[i])] = 1
        _forward_with_capture(capture, ids.to(device), mask.to(device))
    _sync(device)
    return time.perf_counter() - start


def _forward_with_capture(capture: HiddenStateCapture, ids: torch.Tensor, mask: torch.Tensor) -> None:
    captured: dict[int, torch.Tensor] = {}

    def hook(i: int) -> Any:
        return lambda module, args: captured.__setitem__(i, args[0])

    handles = [capture.layers[i].register_forward_pre_hook(hook(i)) for i in capture.aux_layers]
    try:
        out = capture.base(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    keep = mask.bool()
    torch.cat([captured[i] for i in capture.aux_layers], dim=-1)[keep].cpu()
    out.last_hidden_state[keep].cpu()


def bench_single(capture: HiddenStateCapture, seqs: list[list[int]], device: str) -> float:
    start = time.perf_counter()
    for s in seqs:
        capture.capture([s])
    _sync(device)
    return time.perf_counter() - start


def in_process(args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    packed.register()
    loaded = load_model(model_path, args.device, "auto")
    n = loaded.num_layers
    capture = HiddenStateCapture(loaded.model, [2, n // 2, n - 3], loaded.device)
    seqs = _sequences(args.samples, args.max_len, loaded.vocab_size)
    tokens = sum(len(s) for s in seqs)
    with torch.inference_mode():
        probe = packed.make_pack([list(range(10, 40)), list(range(50, 60))], loaded.device)
        backend = packed.choose_backend(lambda: capture.forward_pack(probe)[1])
        bench_packed(capture, seqs[: max(2, len(seqs) // 8)], args.batch_tokens, loaded.device)  # warm-up
        t_packed = bench_packed(capture, seqs, args.batch_tokens, loaded.device)
        t_padded = bench_padded(capture, seqs, args.batch_tokens, loaded.device)
        single = seqs[: args.single_samples]
        t_single = bench_single(capture, single, loaded.device)
    single_tokens = sum(len(s) for s in single)
    return {
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "packed_attention": backend,
        "samples": len(seqs),
        "tokens": tokens,
        "batch_tokens": args.batch_tokens,
        "packed_tokens_per_s": round(tokens / t_packed, 1),
        "padded_sorted_tokens_per_s": round(tokens / t_padded, 1),
        "single_tokens_per_s": round(single_tokens / t_single, 1),
        "packed_over_padded": round(t_padded / t_packed, 2),
        "packed_over_single": round((tokens / t_packed) / (single_tokens / t_single), 2),
    }


def _start_server(
    model_path: str, args: argparse.Namespace, work: Path, mode: str
) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "aerie.engine", "--model-path", model_path, "--port", str(port)]
    cmd += ["--device", args.device, "--mode", mode, "--max-batch-tokens", str(args.batch_tokens)]
    if mode == "extract":
        cmd += ["--dump-dir", str(work / "dumps")]
    log = open(work / f"server-{mode}.log", "wb")  # noqa: SIM115 (lives as long as the process)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((work / f"server-{mode}.log").read_text()[-2000:])
        try:
            if httpx.get(url + "/health_generate", timeout=30).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server not ready")


def over_http(args: argparse.Namespace, model_path: str, vocab: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="aerie-bench-refserver-"))
    figures: dict[str, Any] = {}
    try:
        proc, url = _start_server(model_path, args, work, "extract")
        try:
            figures["extract"] = _http_extract(url, args, vocab, work / "dumps")
            figures["chat"] = _http_chat(url, args)
        finally:
            proc.terminate()
            proc.wait(60)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return figures


def _http_extract(url: str, args: argparse.Namespace, vocab: int, dump_dir: Path) -> dict[str, Any]:
    seqs = _sequences(args.samples, args.max_len, vocab, seed=1)
    requests: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, s in enumerate(seqs):
        if current and used + len(s) > args.batch_tokens:
            requests.append(current)
            current, used = [], 0
        current.append(i)
        used += len(s)
    if current:
        requests.append(current)

    def send(idx: list[int]) -> None:
        body = {
            "input_ids": [seqs[i] for i in idx],
            "rid": [f"s{i}" for i in idx],
            "sampling_params": {"max_new_tokens": 0},
            "return_hidden_states": True,
        }
        reply = httpx.post(url + "/generate", json=body, timeout=600)
        reply.raise_for_status()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(send, requests))
    elapsed = time.perf_counter() - start
    tokens = sum(len(s) for s in seqs)
    written = sum(p.stat().st_size for p in dump_dir.glob("*.safetensors"))
    return {
        "requests": len(requests),
        "in_flight": 2,
        "tokens": tokens,
        "tokens_per_s": round(tokens / elapsed, 1),
        "dump_bytes": written,
        "dump_bytes_per_token": round(written / tokens, 1),
    }


def _http_chat(url: str, args: argparse.Namespace) -> dict[str, Any]:
    prompts = CHAT_PROMPTS[: args.chat_requests]

    def chat(prompt: str) -> int:
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": args.chat_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
        reply.raise_for_status()
        return int(reply.json()["usage"]["completion_tokens"])

    start = time.perf_counter()
    sequential = sum(chat(p) for p in prompts)
    t_seq = time.perf_counter() - start
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        concurrent_tokens = sum(pool.map(chat, prompts))
    t_conc = time.perf_counter() - start
    return {
        "requests": len(prompts),
        "max_tokens": args.chat_tokens,
        "sequential_tokens_per_s": round(sequential / t_seq, 1),
        "concurrent_tokens_per_s": round(concurrent_tokens / t_conc, 1),
        "speedup": round(t_seq / t_conc * concurrent_tokens / sequential, 2),
    }


def _machine(device: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "device": device,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument(
        "--single-samples", type=int, default=32, help="how many samples the one-at-a-time run takes"
    )
    p.add_argument("--chat-requests", type=int, default=8)
    p.add_argument("--chat-tokens", type=int, default=32)
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "refserver-cpu.json"))
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here; nothing measured", file=sys.stderr)
        return 0
    torch.set_num_threads(max(1, min(8, (os.cpu_count() or 2) // 2)))
    target = resolve_target(args.target)
    figures: dict[str, Any] = {"target": target.name, "extraction_in_process": in_process(args, target.path)}
    if not args.skip_http:
        figures.update(over_http(args, target.path, target.geometry.vocab_size))
    result = {
        "date": records.now(),
        "machine": _machine(args.device),
        "command": records.command(),
        "figures": figures,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
