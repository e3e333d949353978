"""The fault matrix: each fault injected for real, the run repeated, the outcome recorded.

    python benchmarks/faults.py [--only CASE ...] [--skip-pipeline] [--out benchmarks/results/faults.json]

Every case injects one fault into real parts and then re-runs without it:

- processes killed (SIGKILL, SIGTERM) during each pipeline stage: `aerie run` (the CLI, the tiny
  smollm2-local pipeline of tests/pipeline_support.py) in a child process, signalled while that stage
  runs, then run again to the end;
- generation against the local fault server (tests/fault_server.py): 429 and 5xx storms, 401, 402,
  HTTP 200 carrying an error, empty answers, the server process killed mid-run, a disk that refuses the
  journal's writes (RLIMIT_FSIZE, as tests/test_full_disk.py), a source that yields nothing valid, two
  runs started on the same run;
- model servers (tests/fake_servers): a stale server on the port, a crash while loading, a child that
  keeps the port after its parent exits;
- S3 (a moto server process): the endpoint down, the endpoint slow (a delaying proxy in front), the
  server killed mid-multipart upload;
- a flipped byte in a stored shard; secrets (the API key, the AWS secret) searched in every log,
  artifact and manifest a run wrote.

Per case: `survived` (the fault was detected or absorbed, the re-run's final state equals an unfaulted
run's, nothing lost, nothing duplicated), `detect_s` (fault -> error surfaced; null where the fault is
absorbed without an error, e.g. a retried 429), `lost`, `duplicates`, `message` (the error the user saw,
or what absorbed the fault). Writes benchmarks/results/faults.json.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import polars as pl  # noqa: E402

from aerie.datasets import SourceSpec  # noqa: E402
from aerie.errors import AerieError, StoreError  # noqa: E402
from aerie.generate.config import DatasetSpec, EndpointConfig, GenerateConfig, SamplingParams  # noqa: E402
from aerie.generate.journal import read_jsonl  # noqa: E402
from aerie.generate.output import read_conversations  # noqa: E402
from aerie.generate.work import run as generate  # noqa: E402
from aerie.serving import ModelServer  # noqa: E402
from aerie.serving.probe import port_is_free  # noqa: E402
from aerie.store import ArtifactStore, LocalStore, StoreConfig, open_store  # noqa: E402
from tests import pipeline_support  # noqa: E402
from tests.fake_servers.scenarios import fake_spec, start_stale_server  # noqa: E402
from tests.fault_server import (  # noqa: E402
    IN_BAND_ERROR,
    REASONING_ONLY,
    FaultServer,
    answer_for,
    status,
)
from tests.processes import free_port, stop  # noqa: E402
from tests.s3_support import BUCKET, DUMMY_ENV, REGION, raw_client  # noqa: E402

API_KEY = "sk-aerie-fault-matrix-secret-0123456789"
KEY_ENV = "AERIE_FAULTS_API_KEY"
N = 24  # conversations per generation case
STAGES = ["generate-sharegpt", "merge", "extract", "train", "evaluate", "deploy"]
BAR = {"generate-sharegpt": "generate-sharegpt:", **{s: f"{s}:" for s in STAGES[1:]}}
# Seconds after a stage's first progress line before the signal: inside the stage, before its end.
KILL_AFTER_S = {
    "generate-sharegpt": 1.5,
    "merge": 1.0,
    "extract": 8.0,
    "train": 0.5,
    "evaluate": 1.0,
    "deploy": 9.0,
}


@dataclass
class Case:
    case: str
    survived: bool
    detect_s: float | None
    lost: int
    duplicates: int
    message: str


# -- generation against the fault server --------------------------------------------------------------


def write_source(path: Path, n: int = N) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(
                json.dumps(
                    {"id": f"c{i:03d}", "conversations": [{"from": "human", "value": f"question {i}"}]}
                )
            )
            f.write("\n")
    return path


def gen_setup(work: Path, url: str, **endpoint: Any) -> tuple[GenerateConfig, DatasetSpec]:
    fields: dict[str, Any] = {
        "base_url": url,
        "api_key_env": KEY_ENV,
        "concurrency": 4,
        "connect_timeout_s": 2.0,
        "read_timeout_s": 5.0,
        "backoff_base_s": 0.02,
        "backoff_max_s": 0.2,
        "max_retries": 4,
        **endpoint,
    }
    cfg = GenerateConfig(endpoint=EndpointConfig(**fields), max_failure_fraction=0.0)
    spec = DatasetSpec(
        name="toy",
        source=SourceSpec(kind="jsonl", path=str(write_source(work / "source.jsonl"))),
        sampling=SamplingParams(max_tokens=8),
    )
    return cfg, spec


def expected_rows(n: int = N) -> dict[str, str]:
    """What an unfaulted run yields: the fault server's deterministic answer to each question."""
    return {f"c{i:03d}": answer_for([{"role": "user", "content": f"question {i}"}]) for i in range(n)}


def journal_ids(store_root: Path, run: str = "r") -> list[str]:
    journal = store_root / run / "generate-toy" / "journal"
    return [rec["id"] for p in sorted(journal.rglob("part-*.jsonl")) for rec in read_jsonl(p)]


def judge_generation(
    store: ArtifactStore, prefix: str, store_root: Path | None = None
) -> tuple[int, int, bool]:
    """(lost, duplicates, final state equal to an unfaulted run) of a finished generation stage."""
    with tempfile.TemporaryDirectory() as tmp:
        frame = read_conversations(store.get_file(f"{prefix}/conversations.parquet", Path(tmp) / "c.parquet"))
    got: dict[str, str] = {}
    dupes = 0
    for row in frame.iter_rows(named=True):
        dupes += row["id"] in got
        got[row["id"]] = row["messages"][-1]["content"]
    if store_root is not None:
        ids = journal_ids(store_root)
        dupes += len(ids) - len(set(ids))
    want = expected_rows()
    lost = len(set(want) - set(got))
    return lost, dupes, got == want


def gen_in_thread(cfg: GenerateConfig, spec: DatasetSpec, store: ArtifactStore, url: str) -> dict[str, Any]:
    """Run generation in a thread; the dict fills with `result` or `error` and `ended` (monotonic)."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = generate(cfg, spec, store=store, run_name="r", base_url=url)
        except Exception as exc:
            out["error"] = exc
        out["ended"] = time.monotonic()

    out["thread"] = threading.Thread(target=target, daemon=True)
    out["thread"].start()
    return out


def fault_then_rerun(
    work: Path,
    plan: Callable[[FaultServer], None],
    *,
    expect_error: bool,
    fix: Callable[[FaultServer], None] = lambda s: None,
    env_key: str | None = API_KEY,
    server_key: str | None = API_KEY,
    **endpoint: Any,
) -> Case:
    """One HTTP fault: run with the fault planned, then (after `fix`) run again; judge the final state."""
    os.environ.pop(KEY_ENV, None)
    if env_key:
        os.environ[KEY_ENV] = env_key
    store_root = work / "store"
    store = LocalStore(store_root)
    with FaultServer(api_key=server_key) as server:
        cfg, spec = gen_setup(work, server.url, **endpoint)
        plan(server)
        began = time.monotonic()
        message = ""
        detect: float | None = None
        try:
            first = generate(cfg, spec, store=store, run_name="r", base_url=server.url)
            retried = first.figures
            message = f"absorbed: {sum(1 for s in server.seen if s.fault.status != 200 or s.fault.raw_body)} faulted answers retried; figures {retried}"
        except AerieError as exc:
            detect = time.monotonic() - began
            message = str(exc).splitlines()[0][:400]
        os.environ[KEY_ENV] = API_KEY
        fix(server)
        final = generate(cfg, spec, store=store, run_name="r", base_url=server.url)
    lost, dupes, equal = judge_generation(store, final.prefix, store_root)
    detected_as_expected = (detect is not None) == expect_error
    leak = API_KEY in message or (env_key or "\0") in message
    return Case(
        "",
        detected_as_expected and equal and not lost and not dupes and not leak,
        detect,
        lost,
        dupes,
        message,
    )


def case_429_storm(work: Path) -> Case:
    def plan(s: FaultServer) -> None:
        s.plan = {f"question {i}": [status(429, retry_after="0.05")] * 3 for i in range(N)}

    return fault_then_rerun(work, plan, expect_error=False)


def case_5xx_storm(work: Path) -> Case:
    def plan(s: FaultServer) -> None:
        s.plan = {f"question {i}": [status(500), status(502), status(503)] for i in range(N)}

    return fault_then_rerun(work, plan, expect_error=False)


def case_http_200_error(work: Path) -> Case:
    def plan(s: FaultServer) -> None:
        s.plan = {f"question {i}": [IN_BAND_ERROR, IN_BAND_ERROR] for i in range(0, N, 2)}

    return fault_then_rerun(work, plan, expect_error=False)


def case_401(work: Path) -> Case:
    return fault_then_rerun(work, lambda s: None, expect_error=True, env_key="sk-wrong-key-not-to-be-printed")


def case_402(work: Path) -> Case:
    def plan(s: FaultServer) -> None:
        s.default = status(402, body='{"error": {"message": "Insufficient credits"}}')

    def fix(s: FaultServer) -> None:
        from tests.fault_server import OK

        s.default = OK

    return fault_then_rerun(work, plan, expect_error=True, fix=fix)


def case_empty_answers(work: Path) -> Case:
    def plan(s: FaultServer) -> None:
        s.plan = {f"question {i}": [REASONING_ONLY] for i in range(0, N, 6)}

    def fix(s: FaultServer) -> None:
        s.plan = {}  # e.g. max_tokens raised: the model now answers after its reasoning

    return fault_then_rerun(work, plan, expect_error=True, fix=fix)


CHILD = """
import resource, signal, sys
from aerie.generate.config import DatasetSpec, GenerateConfig
from aerie.generate.work import run
from aerie.store import LocalStore
if len(sys.argv) > 5:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = int(sys.argv[5])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
cfg = GenerateConfig.model_validate_json(sys.argv[1])
spec = DatasetSpec.model_validate_json(sys.argv[2])
run(cfg, spec, store=LocalStore(sys.argv[3]), run_name="r", base_url=sys.argv[4])
"""


def gen_child(
    cfg: GenerateConfig, spec: DatasetSpec, store_root: Path, url: str, *extra: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD,
            cfg.model_dump_json(),
            spec.model_dump_json(),
            str(store_root),
            url,
            *extra,
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def wait_journal(store_root: Path, lines: int, child: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(journal_ids(store_root)) < lines:
        if child.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"the generating child ended or stalled: {child.stderr.read() if child.stderr else ''}"
            )
        time.sleep(0.05)


def case_generate_killed(work: Path, sig: signal.Signals) -> Case:
    os.environ[KEY_ENV] = API_KEY
    store_root = work / "store"
    with FaultServer(api_key=API_KEY, delay_s=0.1) as server:
        cfg, spec = gen_setup(work, server.url)
        child = gen_child(cfg, spec, store_root, server.url)
        wait_journal(store_root, 6, child)
        os.kill(child.pid, sig)
        child.wait(30)
        before = len(set(journal_ids(store_root)))
        server.delay_s = 0.0
        asked = len(server.seen)
        store = LocalStore(store_root)
        final = generate(cfg, spec, store=store, run_name="r", base_url=server.url)
        again = {s.prompt for s in server.seen[asked:]}
    lost, dupes, equal = judge_generation(store, final.prefix, store_root)
    redone = sum(1 for i in range(N) if f"question {i}" in again) - (N - before)
    message = (
        f"child exited {child.returncode}; {before} conversations journaled before the signal were kept, "
        f"the re-run generated the other {N - before}, {max(redone, 0)} asked twice"
    )
    return Case("", equal and not lost and not dupes and redone <= 0, None, lost, dupes, message)


def case_fault_server_killed(work: Path) -> Case:
    """The endpoint's process dies mid-run (kill -9); it comes back on the same port; the re-run resumes."""
    os.environ[KEY_ENV] = API_KEY
    port = free_port()
    argv = [sys.executable, str(ROOT / "tests" / "fault_server.py"), "--port", str(port), "--delay", "0.1"]
    url = f"http://127.0.0.1:{port}/v1"
    store_root = work / "store"
    store = LocalStore(store_root)
    cfg, spec = gen_setup(work, url, max_retries=3)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    proc.stdout.readline()  # "serving ..."
    run = gen_in_thread(cfg, spec, store, url)
    wait_until(lambda: len(journal_ids(store_root)) >= 4, 60)
    killed = time.monotonic()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    run["thread"].join(120)
    error = run.get("error")
    detect = run["ended"] - killed if error is not None else None
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    proc.stdout.readline()
    try:
        final = generate(cfg, spec, store=store, run_name="r", base_url=url)
    finally:
        stop(proc)
    lost, dupes, equal = judge_generation(store, final.prefix, store_root)
    message = str(error).splitlines()[0][:400] if error else "no error: the run finished before the kill"
    return Case("", error is not None and equal and not lost and not dupes, detect, lost, dupes, message)


def case_disk_full_journal(work: Path) -> Case:
    os.environ[KEY_ENV] = API_KEY
    store_root = work / "store"
    with FaultServer(api_key=API_KEY) as server:
        cfg, spec = gen_setup(work, server.url)
        began = time.monotonic()
        child = gen_child(cfg, spec, store_root, server.url, "3000")
        _, err = child.communicate(timeout=120)
        detect = time.monotonic() - began
        line = next(
            (x for x in err.splitlines() if "Error:" in x and "cannot write" in x),
            err.strip().splitlines()[-1],
        )
        store = LocalStore(store_root)
        final = generate(cfg, spec, store=store, run_name="r", base_url=server.url)
    lost, dupes, equal = judge_generation(store, final.prefix, store_root)
    ok = child.returncode != 0 and "File too large" in line and equal and not lost and not dupes
    return Case("", ok, detect, lost, dupes, line[:400])


def case_two_runs_same_run(work: Path) -> Case:
    os.environ[KEY_ENV] = API_KEY
    store_root = work / "store"
    with FaultServer(api_key=API_KEY, delay_s=0.05) as server:
        cfg, spec = gen_setup(work, server.url)
        child = gen_child(cfg, spec, store_root, server.url)
        wait_journal(store_root, 2, child)
        began = time.monotonic()
        store = LocalStore(store_root)
        message, detect = "the second run was not refused", None
        try:
            generate(cfg, spec, store=store, run_name="r", base_url=server.url)
        except StoreError as exc:
            detect, message = time.monotonic() - began, str(exc)
        child.wait(120)
        final = generate(cfg, spec, store=store, run_name="r", base_url=server.url)
    lost, dupes, equal = judge_generation(store, final.prefix, store_root)
    ok = detect is not None and child.returncode == 0 and final.cache_hit and equal and not lost and not dupes
    return Case("", ok, detect, lost, dupes, message[:400])


def case_source_without_valid_records(work: Path) -> Case:
    os.environ[KEY_ENV] = API_KEY
    store = LocalStore(work / "store")
    with FaultServer(api_key=API_KEY) as server:
        cfg, spec = gen_setup(work, server.url)
        path = Path(spec.source.path or "")
        good = path.read_text()
        path.write_text(good.replace('"from": "human", "value"', '"role": "user", "content"'))
        began = time.monotonic()
        detect, message = None, "accepted"
        try:
            generate(cfg, spec, store=store, run_name="r", base_url=server.url)
        except AerieError as exc:
            detect, message = time.monotonic() - began, str(exc)
        path.write_text(good)  # fixed in place
        final = generate(cfg, spec, store=store, run_name="r", base_url=server.url)
    lost, dupes, equal = judge_generation(store, final.prefix, work / "store")
    return Case("", detect is not None and not final.cache_hit and equal, detect, lost, dupes, message[:400])


def wait_until(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out waiting")
        time.sleep(0.05)


# -- model servers -----------------------------------------------------------------------------------


def case_stale_server(work: Path) -> Case:
    port = free_port()
    stale = start_stale_server(port, work / "stale.log")
    try:
        began = time.monotonic()
        message, detect = "not refused", None
        try:
            ModelServer(fake_spec(work, port=port)).start().stop()
        except AerieError as exc:
            detect, message = time.monotonic() - began, str(exc)
    finally:
        stop(stale)
    with ModelServer(fake_spec(work, port=port)) as server:
        ready = server.info.get("weight_version") == server.spec.weight_version
    return Case(
        "", detect is not None and ready and port_is_free("127.0.0.1", port), detect, 0, 0, message[:400]
    )


def case_server_crash_while_loading(work: Path) -> Case:
    spec = fake_spec(work, "--shards", "4", "--crash-at-shard", "2", "--events-file", str(work / "events"))
    message, detect = "no crash seen", None
    try:
        ModelServer(spec).start()
    except AerieError as exc:
        message = (
            str(exc).splitlines()[0]
            + " | "
            + next((x for x in str(exc).splitlines() if x.startswith("cause")), "")
        )
        detect = time.time() - crash_time(work / "events")
    with ModelServer(fake_spec(work, port=spec.port)) as server:
        ready = bool(server.info)
    return Case("", detect is not None and ready, detect, 0, 0, message[:400])


def crash_time(events: Path) -> float:
    for line in events.read_text().splitlines():
        name, at = line.split()
        if name == "crash":
            return float(at)
    raise RuntimeError("no crash event")


def case_server_orphan_keeps_port(work: Path) -> Case:
    spec = fake_spec(work, "--orphan-keeps-port", "--events-file", str(work / "events"), grace_s=30.0)
    server = ModelServer(spec)
    message, detect = "no crash seen", None
    try:
        server.start()
    except AerieError as exc:
        detect = time.time() - crash_time(work / "events")
        message = " ".join(
            x for x in str(exc).splitlines() if "exit code" in x or x.startswith("left behind")
        )
    report = server.teardown
    ended = bool(report and report.ended and report.port_free)
    return Case(
        "", detect is not None and ended and f"port {spec.port}" in message, detect, 0, 0, message[:400]
    )


# -- S3 ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def moto(port: int | None = None) -> Iterator[tuple[subprocess.Popen[bytes], StoreConfig]]:
    port = port or free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    cfg = StoreConfig(
        uri=f"s3://{BUCKET}/faults",
        s3_endpoint_url=f"http://127.0.0.1:{port}",
        s3_region=REGION,
        multipart_chunk_mb=5,
        max_concurrency=2,
        s3_max_attempts=3,
    )
    try:
        wait_until(lambda: not port_is_free("127.0.0.1", port), 60)
        for _ in range(100):
            with contextlib.suppress(Exception):
                raw_client(cfg).create_bucket(Bucket=BUCKET)
                break
            time.sleep(0.2)
        yield proc, cfg
    finally:
        stop(proc)


def case_s3_down(work: Path) -> Case:
    os.environ[KEY_ENV] = API_KEY
    dead = StoreConfig(
        uri=f"s3://{BUCKET}/faults", s3_endpoint_url=f"http://127.0.0.1:{free_port()}", s3_region=REGION
    )
    with FaultServer(api_key=API_KEY) as server:
        cfg, spec = gen_setup(
            work,
            server.url,
        )
        cfg = cfg.model_copy(update={"work_dir": str(work / "gen-work")})
        began = time.monotonic()
        detect, message = None, "not detected"
        try:
            generate(cfg, spec, store=open_store(dead), run_name="r", base_url=server.url)
        except StoreError as exc:
            detect, message = time.monotonic() - began, str(exc)
        with moto() as (_, live):
            store = open_store(live)
            final = generate(cfg, spec, store=store, run_name="r", base_url=server.url)
            lost, dupes, equal = judge_generation(store, final.prefix)
    ok = detect is not None and detect < 15 and equal and not lost and not dupes
    return Case("", ok, detect, lost, dupes, message[:400])


class DelayProxy:
    """A TCP proxy that holds every chunk it forwards for `delay_s`: a slow S3 endpoint."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target, self.delay = target_port, delay_s
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                time.sleep(self.delay)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.sock.close()


def case_s3_slow(work: Path) -> Case:
    os.environ[KEY_ENV] = API_KEY
    with moto() as (_, live), FaultServer(api_key=API_KEY) as server:
        assert live.s3_endpoint_url
        proxy = DelayProxy(int(live.s3_endpoint_url.rsplit(":", 1)[1]), 0.3)
        slow = live.model_copy(update={"s3_endpoint_url": f"http://127.0.0.1:{proxy.port}"})
        cfg, spec = gen_setup(work, server.url)
        cfg = cfg.model_copy(update={"work_dir": str(work / "gen-work")})
        began = time.monotonic()
        store = open_store(slow)
        final = generate(cfg, spec, store=store, run_name="r", base_url=server.url)
        took = time.monotonic() - began
        lost, dupes, equal = judge_generation(store, final.prefix)
        proxy.close()
    message = f"absorbed: every request and response chunk held 0.3 s; the stage finished in {took:.1f} s"
    return Case("", equal and not lost and not dupes, None, lost, dupes, message)


def case_s3_killed_mid_multipart(work: Path) -> Case:
    src = work / "shard.bin"
    src.write_bytes(os.urandom(16 << 20))  # 4 parts of 5 MiB
    want = hashlib.sha256(src.read_bytes()).hexdigest()
    port = free_port()
    with moto(port) as (proc, cfg):
        store = open_store(cfg)
        killed: list[float] = []

        def kill_once(fraction: float, message: str) -> None:
            if fraction > 0.2 and not killed:
                os.killpg(proc.pid, signal.SIGKILL)
                killed.append(time.monotonic())

        detect, message = None, "the upload did not fail"
        try:
            store.put_file("run/extract/shard-00000.safetensors", src, progress=kill_once)
        except StoreError as exc:
            detect, message = time.monotonic() - killed[0], str(exc)
        proc.wait()
    with moto(port) as (_, cfg):  # the server back (moto keeps no state: an empty bucket again)
        store = open_store(cfg)
        info = store.put_file("run/extract/shard-00000.safetensors", src)
        back = store.get_file(info.key, work / "back.bin")
        equal = hashlib.sha256(back.read_bytes()).hexdigest() == want == info.sha256
        keys = store.list("run")
    ok = detect is not None and equal and src.exists() and keys == ["run/extract/shard-00000.safetensors"]
    return Case("", ok, detect, 0 if src.exists() else 1, len(keys) - 1, message[:400])


# -- a corrupt shard -------------------------------------------------------------------------------------


def case_corrupt_shard(work: Path) -> Case:
    """A flipped byte in a corpus shard (a LocalStore keeps its sha256 beside it): the reader must refuse
    it, naming the shard; after the producing stage is re-run, the corpus reads as before."""
    from aerie.corpus.reader import iter_corpus
    from tests.extract_support import write_corpus

    store = LocalStore(work / "store")
    rows = [
        {"id": f"c{i}", "source": "t", "input_ids": list(range(i, i + 20)), "loss_mask": [0] * 10 + [1] * 10}
        for i in range(30)
    ]
    result = write_corpus(store, "r", {"train": rows}, rows_per_shard=10)
    baseline = list(iter_corpus(store, result, "train"))
    shard = store.local_path(f"{result.prefix}/train-00001.parquet")
    assert shard is not None
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    began = time.monotonic()
    detect, message = None, "the flipped byte was read without an error"
    try:
        list(iter_corpus(store, result, "train"))
    except Exception as exc:
        detect, message = time.monotonic() - began, f"{type(exc).__name__}: {exc}"
    result = write_corpus(store, "r", {"train": rows}, rows_per_shard=10)  # the stage re-run rewrites it
    again = list(iter_corpus(store, result, "train"))
    equal = again == baseline
    ok = detect is not None and "IntegrityError" in message and equal
    return Case("", ok, detect, 0, 0, message[:400])


# -- the pipeline, signalled during each stage ------------------------------------------------------------


class Pipeline:
    """`aerie run smollm2-local <tiny overrides> --no-prefect` in a child, with its state under `work`."""

    def __init__(self, work: Path, port: int) -> None:
        self.work = work
        self.overrides = [
            *pipeline_support.tiny_overrides(work / "store", run="faults", port=port),
            f"extract.work_dir={work / 'extract-work'}",
            f"train.cache_dir={work / 'train-cache'}",
        ]

    def start(self) -> subprocess.Popen[str]:
        aerie = Path(sys.executable).parent / "aerie"
        return subprocess.Popen(
            [str(aerie), "run", "smollm2-local", *self.overrides, "--no-prefect"],
            cwd=self.work,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )

    def finish(self) -> tuple[int, str, str]:
        proc = self.start()
        out, err = proc.communicate(timeout=900)
        return proc.returncode, out, err

    def state(self) -> dict[str, Any]:
        """What a finished run leaves, minus what legitimately varies (timings): per stage its key and
        deterministic figures, and the generated conversations."""
        root = self.work / "store" / "faults"
        state: dict[str, Any] = {}
        for stage in STAGES:
            manifests = sorted((root / stage).glob("*/manifest.json"))
            if not manifests:
                continue
            m = json.loads(manifests[-1].read_text())
            fig = m.get("figures", {})
            keep = {k: fig.get(k) for k in ("records", "tokens", "train_records", "eval_records", "steps")}
            # Keys differ between runs on other ports (the endpoint URL is in generation's manifest).
            state[stage] = {"figures": keep, "complete": len(manifests)}
        conv = sorted((root / "generate-sharegpt").glob("*/conversations.parquet"))
        if conv:
            frame = pl.read_parquet(conv[-1])
            state["conversations"] = [
                (r["id"], r["messages"][-1]["content"]) for r in frame.iter_rows(named=True)
            ]
        return state


def pipeline_case(work: Path, baseline: dict[str, Any], stage: str, sig: signal.Signals) -> Case:
    pipe = Pipeline(work, free_port())
    proc = pipe.start()
    seen = threading.Event()
    lines: list[str] = []

    def watch() -> None:
        assert proc.stderr is not None
        buf = ""
        while chunk := proc.stderr.read(256):
            buf += chunk
            lines.append(chunk)
            if BAR[stage] in buf and not seen.is_set():
                seen.set()
            buf = buf[-400:]

    threading.Thread(target=watch, daemon=True).start()
    if not seen.wait(600):
        proc.kill()
        return Case("", False, None, 0, 0, f"the stage {stage} never started")
    time.sleep(KILL_AFTER_S[stage])
    finished_before = (pipe.state().get(stage) or {}).get("complete", 0) > 0
    os.kill(proc.pid, sig)
    began = time.monotonic()
    code = proc.wait(120)
    exited_s = time.monotonic() - began
    err = "".join(lines).replace("\r", "\n")
    error = next((x for x in err.splitlines() if x.startswith("aerie: error:")), "")
    code2, out2, err2 = pipe.finish()
    after = pipe.state()
    ok_rerun = code2 == 0
    lost = sum(1 for s in STAGES if s not in after)
    ids = [i for i, _ in after.get("conversations", [])]
    dupes = (
        len(ids)
        - len(set(ids))
        + sum(
            max(0, v.get("complete", 1) - 1) for k, v in after.items() if isinstance(v, dict) and k in STAGES
        )
    )
    equal = {k: v for k, v in after.items()} == baseline
    rerun_error = next(
        (x for x in err2.replace("\r", "\n").splitlines() if x.startswith("aerie: error:")), ""
    )
    what = "after the stage had finished" if finished_before else "mid-stage"
    message = f"{sig.name} {what}: exit {code} in {exited_s:.1f} s {error[:200]}; re-run exit {code2}" + (
        f": {rerun_error[:300]}" if rerun_error else ""
    )
    if not equal and ok_rerun:
        diff = [k for k in set(after) | set(baseline) if after.get(k) != baseline.get(k)]
        message += f"; differs from an unfaulted run in {sorted(diff)}"
    return Case(
        "",
        ok_rerun and equal and not lost and not dupes,
        exited_s if sig == signal.SIGTERM else None,
        lost,
        dupes,
        message,
    )


# -- secrets ----------------------------------------------------------------------------------------------


def case_secrets(work: Path) -> Case:
    """A run with an API key (echoed back by a 401 first, as some providers do) and S3 credentials: neither
    secret may appear in any log, artifact, manifest or journal it wrote."""
    os.environ[KEY_ENV] = API_KEY
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    log_path = work / "run.log"
    with moto() as (_, live), FaultServer(api_key=API_KEY) as server:
        cfg, spec = gen_setup(work, server.url)
        cfg = cfg.model_copy(update={"work_dir": str(work / "gen-work")})
        store = open_store(live)
        os.environ[KEY_ENV] = "sk-bad-" + API_KEY  # rejected first: the endpoint echoes what it got
        child = gen_child(cfg, spec, work / "local-store", server.url)
        _, err1 = child.communicate(timeout=120)
        os.environ[KEY_ENV] = API_KEY
        final = generate(cfg, spec, store=store, run_name="r", base_url=server.url)
        log_path.write_text(err1)
        texts = {f"log {log_path.name}": err1}
        for key in store.list(""):
            texts[f"artifact {key}"] = store.get_bytes(key).decode("utf-8", "replace")
        for path in work.rglob("*"):
            if path.is_file() and path.suffix in (".jsonl", ".json", ".log", ".parquet", ".tmp"):
                texts[f"file {path.relative_to(work)}"] = path.read_bytes().decode("utf-8", "replace")
        lost, dupes, equal = judge_generation(store, final.prefix)
    needles = {"API key": API_KEY, "AWS secret": secret}
    leaks = [
        f"{name} in {where}"
        for where, text in texts.items()
        for name, needle in needles.items()
        if needle in text
    ]
    message = f"searched {len(texts)} logs, artifacts and manifests: " + (
        ", ".join(leaks) if leaks else "no secret found"
    )
    return Case("", not leaks and equal and "rejected the API key" in err1, None, lost, dupes, message[:400])


# -- the matrix --------------------------------------------------------------------------------------------


def cases(skip_pipeline: bool) -> list[tuple[str, Callable[[Path], Case]]]:
    out: list[tuple[str, Callable[[Path], Case]]] = [
        ("generate_kill9", lambda w: case_generate_killed(w, signal.SIGKILL)),
        ("generate_sigterm", lambda w: case_generate_killed(w, signal.SIGTERM)),
        ("endpoint_killed_mid_generation", case_fault_server_killed),
        ("http_429_storm", case_429_storm),
        ("http_5xx_storm", case_5xx_storm),
        ("http_401", case_401),
        ("http_402", case_402),
        ("http_200_with_error", case_http_200_error),
        ("empty_answers", case_empty_answers),
        ("source_without_valid_records", case_source_without_valid_records),
        ("disk_full_journal", case_disk_full_journal),
        ("two_runs_same_run", case_two_runs_same_run),
        ("stale_server", case_stale_server),
        ("server_crash_while_loading", case_server_crash_while_loading),
        ("server_child_keeps_port", case_server_orphan_keeps_port),
        ("s3_down", case_s3_down),
        ("s3_slow", case_s3_slow),
        ("s3_killed_mid_multipart", case_s3_killed_mid_multipart),
        ("corrupt_shard", case_corrupt_shard),
        ("secrets", case_secrets),
    ]
    if not skip_pipeline:
        for stage in STAGES:
            for sig in (signal.SIGKILL, signal.SIGTERM):
                name = f"{'kill9' if sig == signal.SIGKILL else 'sigterm'}_during_{stage}"
                out.append((name, lambda w, s=stage, g=sig: pipeline_case(w, BASELINE, s, g)))
    return out


BASELINE: dict[str, Any] = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--skip-pipeline", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "faults.json"))
    args = parser.parse_args()
    for name, value in DUMMY_ENV.items():
        os.environ[name] = value
    scratch = Path(tempfile.mkdtemp(prefix="aerie-faults-"))
    os.environ["AWS_CONFIG_FILE"] = str(scratch / "no-aws-config")
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = str(scratch / "no-aws-credentials")
    selected = [(n, f) for n, f in cases(args.skip_pipeline) if args.only is None or n in args.only]
    if any(n.startswith(("kill9_during", "sigterm_during")) for n, _ in selected):
        pipe = Pipeline(scratch / "baseline", free_port())
        (scratch / "baseline").mkdir()
        code, _, err = pipe.finish()
        if code != 0:
            raise SystemExit(f"the unfaulted pipeline run failed:\n{err[-3000:]}")
        BASELINE.update(pipe.state())
    results: list[Case] = []
    command = "python benchmarks/faults.py" + (" --skip-pipeline" if args.skip_pipeline else "")
    record: dict[str, Any] = {}
    for name, fn in selected:
        work = scratch / name
        work.mkdir()
        began = time.monotonic()
        try:
            case = fn(work)
        except Exception as exc:
            case = Case("", False, None, 0, 0, f"the case itself failed: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        case.case = name
        case.detect_s = None if case.detect_s is None else round(case.detect_s, 3)
        results.append(case)
        print(
            f"{name:36s} {'survived' if case.survived else 'FAILED':9s} {time.monotonic() - began:6.1f}s  "
            f"{case.message[:150]}",
            flush=True,
        )
        record = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "command": command,
            "survived": f"{sum(c.survived for c in results)} of {len(results)}",
            "cases": [asdict(c) for c in results],
        }
        if args.only is None:  # written after every case: a long matrix cut short keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(record["survived"], "survived")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
