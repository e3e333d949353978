"""Requests/s the generation client sustains against a local endpoint that is never the bottleneck,
and its CPU cost per request. Writes benchmarks/results/generate_client-cpu.json.

The endpoint is a raw asyncio HTTP/1.1 server in a separate process that returns a fixed completion
(no framework, no JSON parsing), so the figures measure the client. The server's own CPU time is
recorded too: if it nears the wall time, the server was the bottleneck, not the client.

    .venv/bin/python benchmarks/stages/generate_client.py [--requests 20000] [--concurrency 64 256]

Figures per concurrency: `client` = `ChatClient.complete` alone (what talks to a remote API);
`stage` = the whole dataset path (turn bookkeeping, the fsync'd journal, the Parquet and manifest);
`httpcore_client` = the client on httpx's own transport, the baseline aerie's transport replaces.
`requests_per_client_cpu_s` is what one free core sustains; `requests_per_s` also depends on how
busy the (shared) machine was, which `machine.load_avg_*` records.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository importable
from benchmarks import records  # noqa: E402

OUT = records.RESULTS / "generate_client-cpu.json"
CODE_PATHS = ["benchmarks/stages/generate_client.py", "aerie/generate"]

_BODY = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "model": "bench",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "The quick brown fox jumps over the lazy dog. " * 6,
                },
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 42, "completion_tokens": 60, "total_tokens": 102},
    }
).encode()
_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
    + str(len(_BODY)).encode()
    + b"\r\n\r\n"
    + _BODY
)


class _FixedCompletion(asyncio.Protocol):
    """Answers every HTTP/1.1 request on a keep-alive connection with the same completion."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buffer[:head_end].lower()
            at = head.find(b"content-length:")
            length = (
                int(head[at + 15 : head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None])
                if at >= 0
                else 0
            )
            end = head_end + 4 + length
            if len(self.buffer) < end:
                return
            self.buffer = self.buffer[end:]
            self.transport.write(_RESPONSE)


def _serve(port: int, ready: Any) -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(
            _FixedCompletion, "127.0.0.1", port, backlog=1024
        )
        ready.set()
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _client_run(url: str, requests: int, concurrency: int, transport: str = "lean") -> None:
    from aerie.generate.client import ChatClient
    from aerie.generate.config import EndpointConfig, SamplingParams

    endpoint = EndpointConfig(
        base_url=url, concurrency=concurrency, api_key_env="AERIE_BENCH_NO_KEY", http_transport=transport
    )
    sampling = SamplingParams(max_tokens=64)
    messages = [{"role": "user", "content": "Write one sentence about foxes."}]
    remaining = iter(range(requests))
    async with ChatClient(endpoint, url) as client:

        async def worker() -> None:
            for _ in remaining:
                await client.complete(messages, sampling)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        assert client.stats.succeeded == requests, client.stats


def _stage_run(url: str, requests: int, concurrency: int, root: Path) -> None:
    from aerie.conversation import Conversation, Message
    from aerie.datasets import SourceSpec
    from aerie.generate.config import DatasetSpec, EndpointConfig, GenerateConfig, SamplingParams
    from aerie.generate.work import generate_dataset, key_of, stage_name
    from aerie.manifest import StageDir
    from aerie.store import LocalStore

    cfg = GenerateConfig(
        endpoint=EndpointConfig(base_url=url, concurrency=concurrency, api_key_env="AERIE_BENCH_NO_KEY")
    )
    spec = DatasetSpec(
        name=f"bench-{concurrency}",
        source=SourceSpec(kind="jsonl", path="unused"),
        sampling=SamplingParams(max_tokens=64),
    )
    convs = [
        Conversation(
            id=f"b{i}", source="bench", messages=(Message(role="user", content=f"Question {i} about foxes."),)
        )
        for i in range(requests)
    ]
    store = LocalStore(root)
    result = generate_dataset(
        convs,
        cfg,
        spec,
        stage_dir=StageDir(store, "bench", stage_name(spec), key_of(cfg, spec)),
        base_url=url,
    )
    assert result.figures["records"] == requests, result.figures


def _measure(label: str, fn: Any, server: psutil.Process, requests: int) -> dict[str, Any]:
    server_before = sum(server.cpu_times()[:2])
    cpu_before, wall_before = time.process_time(), time.perf_counter()
    fn()
    wall = time.perf_counter() - wall_before
    cpu = time.process_time() - cpu_before
    server_cpu = sum(server.cpu_times()[:2]) - server_before
    row = {
        "requests": requests,
        "wall_s": round(wall, 3),
        "requests_per_s": round(requests / wall, 1),
        "client_cpu_s": round(cpu, 3),
        "client_cpu_ms_per_request": round(1000 * cpu / requests, 4),
        "client_cpu_share_of_wall": round(cpu / wall, 3),
        # What one fully available core would sustain: the figure that does not depend on how many
        # other processes share the machine during the run.
        "requests_per_client_cpu_s": round(requests / cpu, 1),
        "server_cpu_s": round(server_cpu, 3),
        "server_cpu_share_of_wall": round(server_cpu / wall, 3),
    }
    print(f"{label}: {row}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeat", type=int, default=2, help="best of N (the machine is shared)")
    parser.add_argument("--no-stage", action="store_true", help="measure the client alone")
    parser.add_argument(
        "--baseline-requests",
        type=int,
        default=4000,
        help="requests for the httpcore-transport baseline (0 = skip it)",
    )
    args = parser.parse_args()

    load_at_start = [round(x, 2) for x in os.getloadavg()]
    port = _free_port()
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_serve, args=(port, ready), daemon=True)
    proc.start()
    ready.wait(30)
    server = psutil.Process(proc.pid)
    url = f"http://127.0.0.1:{port}/v1"
    figures: dict[str, Any] = {}
    try:
        asyncio.run(_client_run(url, 500, 16))  # warm-up: imports, first connections
        for concurrency in args.concurrency:
            runs = [
                _measure(
                    f"client c={concurrency}",
                    lambda c=concurrency: asyncio.run(_client_run(url, args.requests, c)),
                    server,
                    args.requests,
                )
                for _ in range(args.repeat)
            ]
            figures[f"client_concurrency_{concurrency}"] = max(runs, key=lambda r: r["requests_per_s"])
            if args.baseline_requests:
                n = args.baseline_requests
                figures[f"httpcore_client_concurrency_{concurrency}"] = _measure(
                    f"httpcore client c={concurrency}",
                    lambda c=concurrency, n=n: asyncio.run(_client_run(url, n, c, "httpcore")),
                    server,
                    n,
                )
            if not args.no_stage:
                runs = []
                for _ in range(args.repeat):
                    with tempfile.TemporaryDirectory() as tmp:
                        runs.append(
                            _measure(
                                f"stage c={concurrency}",
                                lambda c=concurrency, t=tmp: _stage_run(url, args.requests, c, Path(t)),
                                server,
                                args.requests,
                            )
                        )
                figures[f"stage_concurrency_{concurrency}"] = max(runs, key=lambda r: r["requests_per_s"])
    finally:
        proc.terminate()
        proc.join(5)

    machine = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "load_avg_at_start": load_at_start,
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    records.write(OUT, {**records.header(CODE_PATHS, machine), "figures": figures})


if __name__ == "__main__":
    main()
