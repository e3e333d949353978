"""A scripted stand-in for `python -m sglang.launch_server`, for readiness scenarios on a CPU box.

It behaves like SGLang where aerie's lifecycle code looks: SGLang-format log lines (tqdm shard bar on
stderr with `\\r` redraws, `Load weight end`, `KV Cache is allocated`, `Uvicorn running on`, `The server
is fired up and ready to roll!`); the HTTP port is bound only after "loading"; `/health_generate` and
`/health` answer 503 until a warm-up period has passed, then 200; `/server_info`, `/get_server_info`,
`/model_info` echo `--weight-version`. Flags script the faults: crash while loading, hang, answer with
another nonce, ignore SIGTERM, leave a child in the process group, leave /dev/shm-style segments.

Standard library only, so it also runs under an interpreter without aerie's dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def stamp() -> str:
    return time.strftime("[%Y-%m-%d %H:%M:%S]")


def log(message: str) -> None:
    print(f"{stamp()} {message}", flush=True)


def bar(n: int, total: int, t0: float) -> None:
    pct = round(100 * n / total)
    elapsed = time.monotonic() - t0
    sys.stderr.write(
        f"\rLoading safetensors checkpoint shards: {pct:3d}% Completed | {n}/{total} "
        f"[00:{int(elapsed):02d}<00:00, {max(elapsed, 1e-3) / max(n, 1):.2f}s/it]"
    )
    sys.stderr.flush()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--shard-seconds", type=float, default=0.1)
    p.add_argument("--warmup-seconds", type=float, default=0.3)
    p.add_argument("--crash-at-shard", type=int, default=None, help="exit 1 with a traceback after shard K")
    p.add_argument("--crash-message", default="RuntimeError: CUDA out of memory. Tried to allocate 1.50 GiB")
    p.add_argument("--hang-at-shard", type=int, default=None, help="stop making progress after shard K")
    p.add_argument("--fatal-line", default=None, help="print this line after loading, then hang")
    p.add_argument("--report-weight-version", default=None, help="echo this instead of --weight-version")
    p.add_argument("--no-health-generate", action="store_true", help="404 on /health_generate (old server)")
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--child", action="store_true", help="leave a scheduler-like child in the group")
    p.add_argument(
        "--compiler-child",
        default=None,
        help="a short-lived child (as torch.compile's g++) that exits once this file exists",
    )
    p.add_argument("--shm-dir", default=None, help="create sgl_shm_* segments here (unlinked on SIGTERM)")
    p.add_argument(
        "--orphan-keeps-port",
        action="store_true",
        help="once bound, leave a child holding the port (its own session, deaf to SIGTERM) and exit 1",
    )
    p.add_argument("--pid-file", default=None, help="write our pid here once started")
    p.add_argument("--events-file", default=None, help="append '<event> <unix time>' (ready, crash) here")
    return p.parse_args()


def _named(title: str, code: str) -> list[str]:
    """argv of a Python child that names itself `title` as SGLang's setproctitle does: the kernel's
    15-character name plus argv[0], from which psutil reads the full name back."""
    rename = f"import ctypes; ctypes.CDLL(None).prctl(15, {title[:15].encode()!r}, 0, 0, 0)\n"
    return [title, "-c", rename + code]


class State:
    warm = False
    draining = False
    events_file: str | None = None


def event(name: str) -> None:
    """Record when something really happened, for the benchmark's detection latencies."""
    if State.events_file:
        with open(State.events_file, "a") as f:
            f.write(f"{name} {time.time():.6f}\n")


def make_handler(args: argparse.Namespace) -> type[BaseHTTPRequestHandler]:
    version = args.report_weight_version or args.weight_version
    info = {
        "model_path": args.model_path,
        "weight_version": version,
        "tp_size": args.tp_size,
        "port": args.port,
        "version": "0.0.0-fake",
    }

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *a: object) -> None:  # keep the log to startup lines
            return

        def _json(self, code: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?")[0]
            if path == "/health_generate" and args.no_health_generate:
                self._json(404, {"detail": "Not Found"})
            elif path in ("/health", "/health_generate"):
                ok = State.warm and not State.draining
                self._json(200 if ok else 503, {} if ok else {"detail": "starting"})
            elif path in ("/server_info", "/get_server_info"):
                self._json(200, {**info, "status": "ready" if State.warm else "starting"})
            elif path in ("/model_info", "/get_model_info"):
                self._json(200, {"model_path": args.model_path, "weight_version": version})
            elif path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": args.model_path, "object": "model"}]})
            else:
                self._json(404, {"detail": "Not Found"})

    return Handler


def make_segments(shm_dir: str | None) -> list[Path]:
    if not shm_dir:
        return []
    paths = [Path(shm_dir) / f"sgl_shm_{kind}_{os.getpid()}_{uuid.uuid4().hex[:8]}" for kind in ("mm", "ipc")]
    paths.append(Path(shm_dir) / f"multi_tokenizer_args_{os.getpid()}")
    for p in paths:
        p.write_bytes(b"\0" * 64)
    return paths


def load(args: argparse.Namespace) -> None:
    log(
        f"server_args=ServerArgs(model_path='{args.model_path}', port={args.port}, weight_version='{args.weight_version}')"
    )
    log("Load weight begin. avail mem=70.00 GB")
    t0 = time.monotonic()
    bar(0, args.shards, t0)
    for n in range(1, args.shards + 1):
        time.sleep(args.shard_seconds)
        bar(n, args.shards, t0)
        if args.crash_at_shard == n:
            sys.stderr.write("\n")
            print("Traceback (most recent call last):", file=sys.stderr)
            print('  File "fake/model_loader.py", line 42, in load_weights', file=sys.stderr)
            print(args.crash_message, file=sys.stderr, flush=True)
            event("crash")
            sys.exit(1)
        if args.hang_at_shard == n:
            while True:
                time.sleep(3600)
    sys.stderr.write("\n")
    sys.stderr.flush()
    log(f"Load weight end. elapsed={time.monotonic() - t0:.2f} s, type=FakeForCausalLM, avail mem=60.00 GB")
    log("KV Cache is allocated. #tokens: 4096, K size: 0.01 GB, V size: 0.01 GB")
    log("Memory pool end. avail mem=59.00 GB")


def main() -> None:
    args = parse()
    State.events_file = args.events_file
    if args.pid_file:
        Path(args.pid_file).write_text(str(os.getpid()))
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = None
    if args.child:
        # Like SGLang's schedulers: another process in our group, which ignores SIGTERM too if asked.
        code = (
            "import signal,time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if args.ignore_sigterm else "")
            + "time.sleep(3600)"
        )
        child = subprocess.Popen(_named("sglang::scheduler", code), executable=sys.executable)
    if args.compiler_child is not None:
        wait = f"import os, time\nwhile not os.path.exists({args.compiler_child!r}): time.sleep(0.05)"
        compiler = subprocess.Popen([sys.executable, "-c", wait])
        threading.Thread(target=compiler.wait, daemon=True).start()  # reaped, as its compiling parent does
    segments = make_segments(args.shm_dir)
    load(args)

    try:
        server = ThreadingHTTPServer((args.host, args.port), make_handler(args))
    except OSError as exc:
        # What uvicorn prints when a stale server holds the port (SGLang binds only now, after loading).
        print(
            f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address "
            f"('{args.host}', {args.port}): {(exc.strerror or '').lower()}",
            flush=True,
        )
        event("crash")
        sys.exit(1)
    server.daemon_threads = True
    if args.orphan_keeps_port:
        orphan = (
            "import os, signal, time\n"
            "os.setsid()\n"  # out of the launcher's process group and session: killpg misses it
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "time.sleep(3600)\n"
        )
        kept = subprocess.Popen([sys.executable, "-c", orphan], pass_fds=(server.socket.fileno(),))
        log(f"worker pid {kept.pid} started")
        print("RuntimeError: the launcher process died (fake)", file=sys.stderr, flush=True)
        event("crash")
        os._exit(1)

    def on_sigterm(signum: int, frame: object) -> None:
        State.draining = True
        log("SIGTERM received. Draining requests and shutting down...")
        for p in segments:
            p.unlink(missing_ok=True)
        if child is not None:
            child.terminate()
        threading.Thread(target=server.shutdown, daemon=True).start()

    if not args.ignore_sigterm:
        signal.signal(signal.SIGTERM, on_sigterm)
    print(f"INFO:     Uvicorn running on http://{args.host}:{args.port} (Press CTRL+C to quit)", flush=True)

    def warm_up() -> None:
        time.sleep(args.warmup_seconds)
        if args.fatal_line:
            log(args.fatal_line)
            return
        State.warm = True
        event("ready")
        log("The server is fired up and ready to roll!")

    threading.Thread(target=warm_up, daemon=True).start()
    server.serve_forever(poll_interval=0.1)
    server.server_close()
    log("exited")


if __name__ == "__main__":
    main()
