"""The fault matrix: each fault injected for real, proven to have fired, the run repeated, the outcome
compared item by item with an unfaulted run's.

    python -m tests.faults [--cases CASE ...] [--skip-pipeline] [--skip-sglang] [--keep CASES.json]
                           [--out benchmarks/results/faults.json]

(`make faults` runs the whole matrix.) The cases (generation ones in tests/faults/generation.py):

- generation against the local fault server (tests/fault_server.py): 429 and 5xx storms, 401, 402,
  HTTP 200 carrying an error, empty answers, the child generating killed (SIGKILL, SIGTERM), the server
  process killed mid-run, a disk that refuses the journal's writes (RLIMIT_FSIZE), a source that yields
  nothing valid, a prompt edited in place, Ctrl-C with answers in flight (`aerie run`), insecure or
  malformed endpoint URLs, two runs on one run, a lone surrogate in a source line, an endpoint answering
  307 or a 200 HTML page;
- model servers (tests/fake_servers): a stale server on the port, a crash while loading, a child that
  keeps the port after its parent exits;
- a real extraction server SIGKILLed mid-extraction: the reference server, and SGLang on the CPU
  (.venv-sglang) unless `--skip-sglang`;
- the reference server told to fail (tests/faults/servers.py): an out-of-memory allocation in a
  step (absorbed), steps that keep failing (unhealthy, ended by the watch, the run re-run on a fresh one);
- S3 (a moto server process): the endpoint down, the endpoint slow, the server killed during a generation
  stage's multipart upload (the stage re-run);
- a flipped byte in a stage's stored output (the stage folder the error names deleted, the stage re-run);
  secrets searched in every log, artifact and manifest;
- `aerie run` (the tiny smollm2-local pipeline of tests/pipeline_support.py) SIGKILLed or SIGTERMed
  during each stage (during the merge, once its spill folder exists), then run again; two `aerie run`
  at once on one run name;
- the same through Prefect (tests/faults/prefect_runs.py; a real `prefect server start`): `aerie run`
  signalled during a stage (generation's datasets and extraction's slices are subflows there), the API
  server SIGKILLed and restarted mid-run, a deployment run's worker SIGKILLed, a deployment run whose
  flow process was SIGKILLed run again. Each case's `path` says which: `no-prefect` or `prefect`.

Per case: `fired` and `fault` (the counter that proves the fault happened: faulted answers the server
sent, the exit status a signal caused, a kill the injector made; a case whose fault did not fire fails),
`handled` (refused, absorbed, or exited as expected), `path`, `lost`/`duplicates`/`changed`/`extra` (the final
state against an unfaulted run's, by tests/fault_check.py: conversations by id, corpus rows and
hidden-state samples by split and id with their contents' sha256, the drafter's files, evaluation answers,
serving rows, every manifest without times and speeds), `compared` (those counts and the first
differences), `detect_s`, `message`, `wall_s`. `survived` = fired, handled, and equal. Writes
benchmarks/results/faults.json (after every case: a matrix cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from aerie.errors import AerieError, StoreError  # noqa: E402
from aerie.generate.work import run as generate  # noqa: E402
from aerie.serving import ModelServer  # noqa: E402
from aerie.serving.probe import port_is_free  # noqa: E402
from aerie.store import LocalStore, StoreConfig, open_store  # noqa: E402
from tests import pipeline_support  # noqa: E402
from tests.fake_servers.scenarios import fake_spec, start_stale_server  # noqa: E402
from tests.fault_check import STAGES, Snapshot, Verdict, compare, run_snapshot  # noqa: E402
from tests.fault_server import FaultServer  # noqa: E402
from tests.faults import generation as gen  # noqa: E402
from tests.faults import prefect_runs as faults_prefect  # noqa: E402
from tests.faults import servers as faults_servers  # noqa: E402
from tests.faults.case import ROOT, Case, first_line, wait_until  # noqa: E402
from tests.processes import free_port, stop  # noqa: E402
from tests.s3_support import BUCKET, DUMMY_ENV, REGION, raw_client  # noqa: E402
from tests.stage_work import dataset_dir  # noqa: E402

API_KEY, KEY_ENV = gen.API_KEY, gen.KEY_ENV
NO_OUTPUT = "no output to compare (a server start)"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "faults.json"
# The code a record measures (scripts/check_figures.py marks a quote of it stale once these change).
CODE_PATHS = ["tests/faults", "tests/fault_check.py", "tests/fault_server.py", "aerie"]


def no_output(fired: bool, fault: str, detect: float | None, message: str, handled: bool) -> Case:
    case = Case.of(fired, fault, detect, Verdict(), message, handled)
    case.compared = NO_OUTPUT
    return case


# -- model servers -----------------------------------------------------------------------------------


def case_stale_server(work: Path) -> Case:
    port = free_port()
    stale = start_stale_server(port, work / "stale.log")
    try:
        held = not port_is_free("127.0.0.1", port)
        began = time.monotonic()
        message, detect = "not refused", None
        try:
            ModelServer(fake_spec(work, port=port)).start().stop()
        except AerieError as exc:
            detect, message = time.monotonic() - began, first_line(exc)
    finally:
        stop(stale)
    with ModelServer(fake_spec(work, port=port)) as server:
        ready = server.info.get("weight_version") == server.spec.weight_version
    handled = detect is not None and ready and port_is_free("127.0.0.1", port)
    return no_output(held, "a stale server holding the port", detect, message, handled)


def crash_time(events: Path) -> float | None:
    for line in events.read_text().splitlines() if events.exists() else []:
        name, at = line.split()
        if name == "crash":
            return float(at)
    return None


def case_server_crash_while_loading(work: Path) -> Case:
    spec = fake_spec(work, "--shards", "4", "--crash-at-shard", "2", "--events-file", str(work / "events"))
    message, detect = "no crash seen", None
    try:
        ModelServer(spec).start()
    except AerieError as exc:
        cause = next((x for x in str(exc).splitlines() if x.startswith("cause")), "")
        message = first_line(exc) + " | " + cause
        crashed = crash_time(work / "events")
        detect = None if crashed is None else time.time() - crashed
    fired = crash_time(work / "events") is not None
    with ModelServer(fake_spec(work, port=spec.port)) as server:
        ready = bool(server.info)
    return no_output(
        fired, "the server crashed at shard 2 of 4", detect, message, detect is not None and ready
    )


def case_server_orphan_keeps_port(work: Path) -> Case:
    spec = fake_spec(work, "--orphan-keeps-port", "--events-file", str(work / "events"), grace_s=30.0)
    server = ModelServer(spec)
    message, detect = "no crash seen", None
    try:
        server.start()
    except AerieError as exc:
        crashed = crash_time(work / "events")
        detect = None if crashed is None else time.time() - crashed
        message = " ".join(
            x for x in str(exc).splitlines() if "exit code" in x or x.startswith("left behind")
        )
    report = server.teardown
    ended = bool(report and report.ended and report.port_free)
    fired = crash_time(work / "events") is not None and f"port {spec.port}" in message
    return no_output(
        fired, "the server exited, its child kept the port", detect, message, detect is not None and ended
    )


# -- a real extraction server killed mid-extraction ----------------------------------------------------


def extraction_case(work: Path, backend: str) -> Case:
    """The corpus of a few ShareGPT conversations extracted twice: unfaulted, and with the server
    SIGKILLed once it is extracting (restarted by the stage); every sample compared bit for bit."""
    from aerie.extract import work as extract_work
    from aerie.extract.config import ExtractConfig
    from aerie.serving import ServerConfig
    from aerie.targets import resolve_target
    from tests.evaluate_support import corpus_result
    from tests.extract_support import KillServer
    from tests.stage_work import staged

    extract = staged("extract", extract_work.run)

    target = resolve_target("smollm2-135m-instruct")
    store = LocalStore(work / "store")
    corpus = corpus_result(store, "c", target, n=8)

    def server(port: int) -> ServerConfig:
        if backend == "reference":
            return ServerConfig(backend="reference", device="cpu", port=port)
        from tests.sglang_support import cpu_config

        return cpu_config(port, work / "shim-calls")

    def config(name: str) -> ExtractConfig:
        common = {"shard_bytes": 1 << 20, "batch_tokens": 256, "requests_in_flight": 1, "dump_timeout_s": 120}
        dtype = "bf16" if backend == "reference" else "fp8"
        return ExtractConfig(storage_dtype=dtype, work_dir=str(work / name), max_restarts=1, **common)

    runs: dict[str, Snapshot] = {}
    killed: list[int] = []
    restarts = 0
    began = time.monotonic()
    for name in ("unfaulted", "killed"):
        port = free_port()
        kill = KillServer(port, 0.0) if name == "killed" else None
        progress = kill if kill is not None else (lambda fraction, message: None)
        result = extract(
            config(name),
            store=store,
            run_name=name,
            target=target,
            corpus=corpus,
            server=server(port),
            progress=progress,
        )
        if kill is not None:
            killed, restarts = kill.killed, int(result.figures.get("server_restarts", 0))
        runs[name] = extraction_snapshot(work / "store" / name, result.prefix, name, port)
    verdict = compare(runs["unfaulted"], runs["killed"])
    message = f"{len(killed)} kill(s), {restarts} server restart(s); both extractions took {time.monotonic() - began:.0f} s"
    return Case.of(
        len(killed) == 1,
        f"{backend} server SIGKILLed while extracting",
        None,
        verdict,
        message,
        restarts == 1,
    )


def extraction_snapshot(run_dir: Path, prefix: str, name: str, port: int) -> Snapshot:
    # run_snapshot reads every stage folder under the run; here only the extract stage is in it.
    subs = [(f"/{name}/", "/<run>/"), (f":{port}", ":<port>"), (f"--port {port}", "--port <port>")]
    snap = run_snapshot(run_dir, subs)
    manifest = snap.manifests.get("extract", {})
    for field in ("run", "server", "config"):  # the run's name, the port, the work folder: per run
        manifest.pop(field, None)
    return snap


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
    dead_port = free_port()
    dead = StoreConfig(
        uri=f"s3://{BUCKET}/faults", s3_endpoint_url=f"http://127.0.0.1:{dead_port}", s3_region=REGION
    )
    with FaultServer(api_key=API_KEY) as server:
        cfg, spec = gen.gen_setup(work, server.url)
        cfg = cfg.model_copy(update={"work_dir": str(work / "gen-work")})
        fired = port_is_free("127.0.0.1", dead_port)  # nothing listens where the store points
        began = time.monotonic()
        detect, message = None, "not detected"
        try:
            generate(cfg, spec, dataset_dir(open_store(dead), "r", cfg, spec), base_url=server.url)
        except StoreError as exc:
            detect, message = time.monotonic() - began, first_line(exc)
        with moto() as (_, live):
            store = open_store(live)
            final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
            verdict = gen.judged(work, store, final, server.url)
    handled = detect is not None and detect < 15
    return Case.of(fired, "the S3 endpoint down (nothing listening)", detect, verdict, message, handled)


class DelayProxy:
    """A TCP proxy that holds every chunk it forwards for `delay_s`: a slow S3 endpoint."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target, self.delay = target_port, delay_s
        self.delayed = 0  # chunks held: the fault's counter
        self.parts = 0  # multipart part uploads seen in the requests
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
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:  # the server is down: so is the proxy's connection, at once
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                self.parts += data.count(b"partNumber=")
                time.sleep(self.delay)
                self.delayed += 1
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
        cfg, spec = gen.gen_setup(work, server.url)
        cfg = cfg.model_copy(update={"work_dir": str(work / "gen-work")})
        began = time.monotonic()
        store = open_store(slow)
        final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
        took = time.monotonic() - began
        verdict = gen.judged(work, store, final, server.url)
        proxy.close()
    message = f"absorbed: every request and response chunk held 0.3 s; the stage finished in {took:.1f} s"
    return Case.of(proxy.delayed > 0, f"{proxy.delayed} S3 chunks held 0.3 s each", None, verdict, message)


LONG = 48 * 1024  # characters of random text per question: the stage's output needs several 5 MiB parts


def long_questions(n: int) -> dict[int, str]:
    rng = random.Random(7)  # the same questions in the faulted and the unfaulted run
    return {i: f"question {i} " + "".join(rng.choices(string.ascii_letters, k=LONG)) for i in range(n)}


def case_s3_killed_mid_multipart(work: Path) -> Case:
    """A generation stage writing to S3 (moto) whose output is uploaded in 5 MiB parts: the S3 server is
    SIGKILLed once the first part is on its way. The stage fails naming the store; the server comes back
    (moto keeps nothing: an empty bucket), the stage is re-run, and its output equals an unfaulted
    run's."""
    os.environ[KEY_ENV] = API_KEY
    n = 160
    edit = long_questions(n)
    gen.write_source(work / "source.jsonl", n=n, edit=edit)
    port = free_port()
    killed: list[float] = []
    detect, message = None, "the stage did not fail"
    with FaultServer(api_key=API_KEY) as server:
        cfg, spec = gen.gen_setup(work, server.url)
        cfg = cfg.model_copy(update={"work_dir": str(work / "gen-work")})
        with moto(port) as (proc, live):
            # Through a proxy holding each 64 KiB chunk 10 ms: a part lasts about a second, so the kill
            # lands inside the upload.
            proxy = DelayProxy(port, 0.01)
            store = open_store(live.model_copy(update={"s3_endpoint_url": f"http://127.0.0.1:{proxy.port}"}))

            def kill_at_first_part() -> None:
                with contextlib.suppress(RuntimeError):
                    wait_until(lambda: proxy.parts > 0, 600)
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed.append(time.monotonic())

            threading.Thread(target=kill_at_first_part, daemon=True).start()
            try:
                generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
            except StoreError as exc:
                detect, message = (time.monotonic() - killed[0] if killed else None), first_line(exc)
            proc.wait()
        parts = proxy.parts
        with moto(port):  # the server back, empty; the stage re-run through the same proxy
            final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
            verdict = gen.judged(work, store, final, server.url, edit=edit, n=n)
        proxy.close()
    message += f"; {parts} part upload(s) seen before the kill; the stage re-run on the restarted server"
    return Case.of(
        bool(killed),
        "S3 server SIGKILLed during a multipart upload",
        detect,
        verdict,
        message,
        detect is not None,
    )


# -- a corrupt shard -------------------------------------------------------------------------------------


def case_corrupt_shard(work: Path) -> Case:
    """A flipped byte in a stage's stored output (generation's conversations.parquet; a LocalStore keeps
    its sha256 beside it): reading it must be refused, naming the object and what to delete; doing what
    the message says (delete the stage's folder it names, re-run the stage), the output equals an
    unfaulted run's."""
    os.environ[KEY_ENV] = API_KEY
    store = LocalStore(work / "store")
    with FaultServer(api_key=API_KEY) as server:
        cfg, spec = gen.gen_setup(work, server.url)
        result = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
        key = f"{result.prefix}/conversations.parquet"
        shard = store.local_path(key)
        assert shard is not None
        before = shard.read_bytes()
        data = bytearray(before)
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        fired = hashlib.sha256(shard.read_bytes()).digest() != hashlib.sha256(before).digest()
        began = time.monotonic()
        detect, message = None, "the flipped byte was read without an error"
        try:
            store.get_file(key, work / "read" / "conversations.parquet")
        except Exception as exc:
            detect, message = time.monotonic() - began, f"{type(exc).__name__}: {first_line(exc)}"
        # What the message says to delete (the stage's folder), then the stage re-run.
        named = re.search(r"corrupt: delete (\S+) ", message)
        if named:
            shutil.rmtree(named.group(1))
        final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
        try:
            verdict = gen.judged(work, store, final, server.url)
        except Exception as exc:  # the re-run left no readable output: everything it held is lost
            verdict = compare(gen.unfaulted(work), Snapshot())
            message += f"; after the re-run: {type(exc).__name__}: {first_line(exc)[:200]}"
    told = "IntegrityError" in message and named is not None
    return Case.of(fired, "1 byte flipped in a stored stage output", detect, verdict, message, told)


# -- secrets ----------------------------------------------------------------------------------------------


def case_secrets(work: Path) -> Case:
    """A run with an API key (echoed back by a 401 first, as some providers do) and S3 credentials: neither
    secret may appear in any log, artifact, manifest or journal it wrote."""
    os.environ[KEY_ENV] = API_KEY
    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    with moto() as (_, live), FaultServer(api_key=API_KEY) as server:
        cfg, spec = gen.gen_setup(work, server.url)
        cfg = cfg.model_copy(update={"work_dir": str(work / "gen-work")})
        store = open_store(live)
        os.environ[KEY_ENV] = "sk-bad-" + API_KEY  # rejected first: the endpoint echoes what it got
        child = gen.gen_child(cfg, spec, work / "local-store", server.url)
        _, err1 = child.communicate(timeout=120)
        echoed = gen.served(server, gen.with_code(401))
        os.environ[KEY_ENV] = API_KEY
        final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
        texts = {"log of the rejected run": err1}
        for key in store.list(""):
            texts[f"artifact {key}"] = store.get_bytes(key).decode("utf-8", "replace")
        for path in work.rglob("*"):
            if path.is_file() and path.suffix in (".jsonl", ".json", ".log", ".parquet", ".tmp"):
                texts[f"file {path.relative_to(work)}"] = path.read_bytes().decode("utf-8", "replace")
        verdict = gen.judged(
            work,
            store,
            final,
            server.url,
        )
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
    handled = not leaks and child.returncode != 0
    return Case.of(echoed > 0, f"{echoed} HTTP 401 served echoing the key", None, verdict, message, handled)


# -- the pipeline, signalled during each stage ------------------------------------------------------------


class Pipeline:
    """`aerie run smollm2-local <tiny overrides> --no-prefect` in a child, with its state under `work`
    (its temporary files too: $TMPDIR is `work/tmp`, so what a killed stage leaves there is seen)."""

    def __init__(
        self, work: Path, port: int, run: str = "faults", prefect: dict[str, str] | None = None
    ) -> None:
        self.work, self.port, self.run = work, port, run
        self.prefect = prefect  # the environment that points `aerie run` at a Prefect server, or None
        self.tmp = work / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.overrides = [
            *pipeline_support.tiny_overrides(work / "store", run=run, port=port),
            f"extract.work_dir={work / 'extract-work'}",
            f"train.cache_dir={work / 'train-cache'}",
            # Six steps, each reported: a signal at the first report lands before the last step (one
            # during the last step is not acted on: training then completes instead).
            "train.epochs=6",
            "train.log_every=1",
            # The canary's reference forward on every run: by default it runs only while the machine has
            # the memory free, which on a shared machine differs between the runs compared.
            "extract.canary_reference=always",
        ]

    def start(self) -> subprocess.Popen[str]:
        aerie = Path(sys.executable).parent / "aerie"
        return subprocess.Popen(
            [
                str(aerie),
                "run",
                "smollm2-local",
                *self.overrides,
                *([] if self.prefect else ["--no-prefect"]),
            ],
            cwd=self.work,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env(),
        )

    def env(self) -> dict[str, str]:
        # Unbuffered: under Prefect the stages' progress is logged to a pipe, which Python otherwise
        # flushes only every few KiB (the stage is then seen late, often after it finished).
        env = {"PYTHONPATH": str(ROOT), "TMPDIR": str(self.tmp), "PYTHONUNBUFFERED": "1"}
        return {**os.environ, **env, **(self.prefect or {})}

    @property
    def path(self) -> str:
        return "prefect" if self.prefect else "no-prefect"

    def finish(self) -> tuple[int, str, str]:
        proc = self.start()
        out, err = proc.communicate(timeout=2400)  # a loaded shared machine
        return proc.returncode, out, err

    def completed(self, stage: str) -> bool:
        return any((self.work / "store" / self.run / stage).glob("*/manifest.json"))

    def snapshot(self) -> Snapshot:
        port = str(self.port)
        subs = [(str(self.work), "<work>"), (f":{port}", ":<port>"), (f"--port {port}", "--port <port>")]
        snap = run_snapshot(self.work / "store" / self.run, subs)
        for manifest in snap.manifests.values():
            drop_port(manifest, self.port)
        return snap

    def left_in_tmp(self) -> list[str]:
        """A stage's temporary work folders left in $TMPDIR (server logs and torch's compile cache are
        kept there by design)."""
        kept = ("aerie-servers", "torchinductor_")
        return sorted(p.name for p in self.tmp.iterdir() if not p.name.startswith(kept))


def drop_port(value: Any, port: int) -> None:
    """A `port` field equal to this run's server port (a per-run choice) is not compared."""
    if isinstance(value, dict):
        if value.get("port") == port:
            value["port"] = "<port>"
        for v in value.values():
            drop_port(v, port)
    elif isinstance(value, list):
        for v in value:
            drop_port(v, port)


BASELINE: dict[str, Snapshot] = {}  # the unfaulted pipeline's state, by path (no-prefect, prefect)
SCRATCH: list[Path] = []  # the matrix's scratch folder


def prefect_env(work: Path) -> dict[str, str]:
    """The environment pointing `aerie run` at the matrix's Prefect server (started on first use)."""
    faults_prefect.SERVER.start(SCRATCH[0] / "prefect-server")
    return faults_prefect.SERVER.env(work / "prefect-client")


def baseline(path: str) -> Snapshot:
    """The unfaulted pipeline's state on `path`, which every pipeline case on it must equal (run once,
    before the first of them)."""
    if path not in BASELINE:
        work = SCRATCH[0] / f"baseline-{path}"
        work.mkdir(parents=True, exist_ok=True)
        pipe = Pipeline(work, free_port(), prefect=prefect_env(work) if path == "prefect" else None)
        code, _, err = pipe.finish()
        if code != 0:
            raise SystemExit(f"the unfaulted pipeline run ({path}) failed:\n{err[-3000:]}")
        BASELINE[path] = pipe.snapshot()
    return BASELINE[path]


def path_of(name: str) -> str:
    return "prefect" if name.startswith("prefect_") else "no-prefect"


def prefect_case(name: str) -> Callable[[Path], Case]:
    def run(work: Path) -> Case:
        pipe = Pipeline(work, free_port(), prefect=prefect_env(work))
        return faults_prefect.CASES[name](pipe, baseline("prefect"))

    return run


BAR = {s: f"{s}:" for s in STAGES}
# Seconds after a stage's first progress line before the signal: inside the stage, before its end, for
# the stages that last long enough for a fixed wait. The short ones are signalled on a sign of their own
# work instead (`TRIGGER`): a fixed wait outlasted the tiny generation and training once.
KILL_AFTER_S = {"evaluate": 1.0, "deploy": 9.0}
# The first training step the stage reports (its progress line "step 1/6 loss ...", under Prefect logged
# with the stage's title).
TRAIN_STEP = re.compile(r"(train:|drafter training)[^\n]*step \d+/\d+ loss")
# The stages' titles under Prefect (flows/*.py), which their logged progress lines begin with.
PREFECT_TITLE = {
    "generate-sharegpt": "generation",
    "merge": "merging the corpus",
    "extract": "hidden-state extraction",
    "train": "drafter training",
    "evaluate": "speculative decoding evaluation",
    "deploy": "deployment benchmark",
}


def journaled(pipe: Pipeline) -> bool:
    """The generation journal holds its first answer (the signal then lands with the rest in flight)."""
    parts = (pipe.work / "store" / pipe.run / "generate-sharegpt" / "journal").glob("*/part-*.jsonl")
    return any(part.stat().st_size > 0 for part in parts)


def extracting(pipe: Pipeline) -> bool:
    """The extraction recorded its first closed shard (its progress file): samples are on their way,
    the rest still to come. A fixed wait after its title came too late under Prefect, whose logged
    title can trail the work."""
    return any((pipe.work / "store" / pipe.run / "extract").rglob("*progress.json"))


def stage_at_work(pipe: Pipeline, stage: str, stderr: Callable[[], str]) -> Callable[[], bool]:
    """When the stage has visibly begun its work (or finished: the case then says it fired too late)."""
    sign = {
        "generate-sharegpt": lambda: journaled(pipe),
        "merge": lambda: any(pipe.tmp.glob("aerie-merge-*/spill")),
        "extract": lambda: extracting(pipe),
        "train": lambda: TRAIN_STEP.search(stderr().replace("\r", "\n")) is not None,
    }[stage]
    return lambda: sign() or pipe.completed(stage)


def pipeline_case(work: Path, stage: str, sig: signal.Signals, prefect: bool = False) -> Case:
    pipe = Pipeline(work, free_port(), prefect=prefect_env(work) if prefect else None)
    proc = pipe.start()
    seen = threading.Event()
    lines: list[str] = []

    # Under Prefect a part's progress line adds the part's name to the title ("generation, sharegpt: ").
    marker = PREFECT_TITLE[stage] if prefect else BAR[stage]

    def watch(stream: IO[str] | None) -> None:
        # Both streams: under Prefect the stages' progress is logged (by Prefect's console handler).
        assert stream is not None
        buf = ""
        while chunk := stream.read(256):
            buf += chunk
            lines.append(chunk)
            if marker in buf and not seen.is_set():
                seen.set()
            buf = buf[-400:]

    for stream in (proc.stderr, proc.stdout):
        threading.Thread(target=watch, args=(stream,), daemon=True).start()
    at_work = stage_at_work(pipe, stage, lambda: "".join(lines)) if stage not in KILL_AFTER_S else None
    with contextlib.suppress(RuntimeError):  # the title, or the stage's work seen before its title
        wait_until(lambda: seen.is_set() or (at_work is not None and at_work()), 600)
    if not (seen.is_set() or (at_work is not None and at_work())):
        proc.kill()
        return no_output(False, f"{sig.name} during {stage}", None, f"the stage {stage} never started", False)
    if stage in KILL_AFTER_S:
        time.sleep(KILL_AFTER_S[stage])
    elif at_work is not None:
        with contextlib.suppress(RuntimeError):
            wait_until(at_work, 120)
    spill_at_kill = [p.name for p in pipe.tmp.glob("aerie-merge-*")]
    finished_before = pipe.completed(stage)
    os.kill(proc.pid, sig)
    began = time.monotonic()
    code = proc.wait(120)
    exited_s = time.monotonic() - began
    err = "".join(lines).replace("\r", "\n")
    error = next((x for x in err.splitlines() if x.startswith("aerie: ")), "")
    held = wait_port_free(pipe.port, 20)
    code2, _, err2 = pipe.finish()
    rerun_lines = [x for x in err2.replace("\r", "\n").splitlines() if x.strip()]
    # A failed re-run names its error: aerie's own line, or (under Prefect, which logs a traceback) its end.
    rerun_error = next((x for x in rerun_lines if x.startswith("aerie: error:")), "")
    if code2 != 0 and not rerun_error:
        rerun_error = " | ".join(rerun_lines[-3:])
    left = pipe.left_in_tmp()
    verdict = compare(baseline(pipe.path), pipe.snapshot())
    fired = not finished_before and code != 0
    what = "after the stage had finished" if finished_before else "mid-stage"
    message = f"{sig.name} {what}: exit {code} in {exited_s:.1f} s {error[:200]}; re-run exit {code2}"
    message += f": {rerun_error[:300]}" if rerun_error else ""
    if stage == "merge":
        message += f"; spill folder at the kill: {spill_at_kill or 'none'}"
    if left:
        message += f"; left in $TMPDIR after the re-run: {left[:4]}"
    if held:
        message += f"; a process (pid {held}) still held the server port 20 s after the signal"
    handled = code2 == 0 and not left and not held
    return Case.of(
        fired,
        f"{sig.name} during {stage}",
        exited_s if sig == signal.SIGTERM else None,
        verdict,
        message,
        handled,
    )


def wait_port_free(port: int, timeout: float) -> int | None:
    """None once nothing listens on `port`; else, after `timeout`, the pid still listening (stopped
    here, so the next case starts clean)."""
    from tests.extract_support import listener_pid

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_is_free("127.0.0.1", port):
            return None
        time.sleep(0.2)
    pid = listener_pid(port)
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pid or None


def case_concurrent_pipelines(work: Path) -> Case:
    """Two `aerie run` at once on one store and run name (their servers on two ports): the second must
    wait or be refused, saying why; the first completes; the run's state equals an unfaulted run's."""
    first = Pipeline(work, free_port())
    second = Pipeline(work, free_port())
    p1 = first.start()
    assert p1.stderr is not None
    buf = ""
    while BAR["generate-sharegpt"] not in buf:
        chunk = p1.stderr.read(128)
        if not chunk:
            break
        buf += chunk
    began = time.monotonic()
    p2 = second.start()
    threading.Thread(target=p1.communicate, daemon=True).start()  # drain its pipes
    out2, err2 = p2.communicate(timeout=900)
    took2 = time.monotonic() - began
    overlapped = p1.poll() is None  # the first was still running when the second ended
    code1 = p1.wait(900)
    line = next(
        (x for x in err2.replace("\r", "\n").splitlines() if x.startswith("aerie: ")), "no error line"
    )
    verdict = compare(baseline("no-prefect"), first.snapshot())
    refused = p2.returncode != 0 and "another" in line
    message = f"second run: exit {p2.returncode} after {took2:.1f} s: {line[:300]}; first run: exit {code1}"
    handled = code1 == 0 and (refused or p2.returncode == 0)
    return Case.of(
        overlapped,
        "a second `aerie run` on the same run while the first ran",
        took2,
        verdict,
        message,
        handled,
    )


# -- the matrix --------------------------------------------------------------------------------------------


# `aerie run` through Prefect signalled mid-stage: generation's datasets and extraction's slices run as
# subflows there, the merge and training as the stages' own subflows.
PREFECT_STAGE_FAULTS = [
    ("generate-sharegpt", signal.SIGKILL),
    ("merge", signal.SIGTERM),
    ("extract", signal.SIGKILL),
    ("extract", signal.SIGTERM),
    ("train", signal.SIGKILL),
]


def signalled(stage: str, sig: signal.Signals, prefect: bool = False) -> Callable[[Path], Case]:
    return lambda work: pipeline_case(work, stage, sig, prefect)


def cases(skip_pipeline: bool, skip_sglang: bool) -> list[tuple[str, Callable[[Path], Case]]]:
    out: list[tuple[str, Callable[[Path], Case]]] = [
        ("generate_kill9", lambda w: gen.case_generate_killed(w, signal.SIGKILL)),
        ("generate_sigterm", lambda w: gen.case_generate_killed(w, signal.SIGTERM)),
        ("generate_ctrl_c", gen.case_ctrl_c),
        ("endpoint_killed_mid_generation", gen.case_fault_server_killed),
        ("http_429_storm", gen.case_429_storm),
        ("http_5xx_storm", gen.case_5xx_storm),
        ("http_401", gen.case_401),
        ("http_402", gen.case_402),
        ("http_200_with_error", gen.case_http_200_error),
        ("empty_answers", gen.case_empty_answers),
        ("source_without_valid_records", gen.case_source_without_valid_records),
        ("prompt_edited_in_place", gen.case_edited_prompt),
        ("insecure_endpoint_url", gen.case_insecure_url),
        ("disk_full_journal", gen.case_disk_full_journal),
        ("two_runs_same_run", gen.case_two_runs_same_run),
        ("lone_surrogate_in_source", gen.case_lone_surrogate),
        ("endpoint_redirect_307", gen.case_redirect_307),
        ("endpoint_html_200", gen.case_html_200),
        ("stale_server", case_stale_server),
        ("server_crash_while_loading", case_server_crash_while_loading),
        ("server_child_keeps_port", case_server_orphan_keeps_port),
        ("reference_server_killed_mid_extraction", lambda w: extraction_case(w, "reference")),
        ("reference_server_oom_in_step", faults_servers.case_oom_in_step),
        ("reference_server_unhealthy_restarted", faults_servers.case_unhealthy_restarted),
        ("generation_server_relaunched", faults_servers.case_generation_server_relaunched),
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
                out.append((name, signalled(stage, sig)))
        out.append(("two_pipelines_same_run", case_concurrent_pipelines))
        for stage, sig in PREFECT_STAGE_FAULTS:
            name = f"prefect_{'kill9' if sig == signal.SIGKILL else 'sigterm'}_during_{stage}"
            out.append((name, signalled(stage, sig, prefect=True)))
        out += [(name, prefect_case(name)) for name in faults_prefect.CASES]
    if not skip_sglang and (ROOT / ".venv-sglang" / "bin" / "python").exists():
        out.append(("sglang_killed_mid_extraction", lambda w: extraction_case(w, "sglang")))
    return out


PIPELINE_CASES = ("kill9_during", "sigterm_during", "two_pipelines", "prefect_")


def git_commit() -> str:
    """The commit the matrix runs on, `+changes` where the code it runs (aerie, benchmarks, tests)
    differs from it: a record then says it did not run that commit alone."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(
        [
            "git",
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            "aerie",
            "benchmarks",
            "tests",
            "flows",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases",
        nargs="+",
        default=None,
        metavar="CASE",
        help="run these cases only (names as in the record); their record goes to --out, which must then "
        "be another file than the whole matrix's unless --keep names the record they update",
    )
    parser.add_argument("--skip-pipeline", action="store_true")
    parser.add_argument("--skip-sglang", action="store_true")
    parser.add_argument(
        "--keep", default=None, help="a record whose other cases are kept (with their commit)"
    )
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    known = [n for n, _ in cases(args.skip_pipeline, args.skip_sglang)]
    unknown = sorted(set(args.cases or ()) - set(known))
    if unknown:
        parser.error(f"no such case: {', '.join(unknown)}; the cases: {', '.join(known)}")
    if args.cases and not args.keep and Path(args.out).resolve() == DEFAULT_OUT.resolve():
        parser.error(f"a subset would replace the whole matrix's record {DEFAULT_OUT}: name another --out")
    for name, value in DUMMY_ENV.items():
        os.environ[name] = value
    scratch = Path(tempfile.mkdtemp(prefix="aerie-faults-"))
    SCRATCH.append(scratch)
    os.environ["AWS_CONFIG_FILE"] = str(scratch / "no-aws-config")
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = str(scratch / "no-aws-credentials")
    selected = [
        (n, f)
        for n, f in cases(args.skip_pipeline, args.skip_sglang)
        if args.cases is None or n in args.cases
    ]
    kept: list[dict[str, Any]] = []
    if args.keep:
        names = {n for n, _ in selected}
        kept = [c for c in json.loads(Path(args.keep).read_text())["cases"] if c["case"] not in names]
    started = time.monotonic()
    commit = git_commit()
    results: list[dict[str, Any]] = []
    command = "python -m tests.faults " + " ".join(sys.argv[1:])
    for name, fn in selected:
        work = scratch / name
        work.mkdir()
        if name.startswith(PIPELINE_CASES):
            baseline(path_of(name))  # run before the case: its time is not the case's
        began = time.monotonic()
        try:
            case = fn(work)
        except Exception as exc:
            case = no_output(False, "", None, f"the case itself failed: {type(exc).__name__}: {exc}", False)
            case.compared = "not reached"
            traceback.print_exc()
        case.case, case.path = name, path_of(name)
        case.wall_s = round(time.monotonic() - began, 1)
        results.append({**asdict(case), "commit": commit})
        verdict = "survived" if case.survived else "FAILED"
        print(
            f"{name:40s} {verdict:9s} {case.wall_s:6.1f}s fired={case.fired} {case.compared[:80]} | {case.message[:120]}",
            flush=True,
        )
        every = kept + results
        record = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "command": command.strip(),
            "commit": commit,
            "code_paths": CODE_PATHS,
            "survived": f"{sum(c['survived'] for c in every)} of {len(every)}",
            "fired": f"{sum(c['fired'] for c in every)} of {len(every)}",
            "lost": sum(c["lost"] for c in every),
            "duplicates": sum(c["duplicates"] for c in every),
            "changed": sum(c["changed"] for c in every),
            "wall_s": round(time.monotonic() - started, 1),
            "cases": every,
        }
        # After every case: a long matrix cut short keeps what it measured.
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"{sum(c['survived'] for c in results)} of {len(results)} survived in {time.monotonic() - started:.0f} s"
    )
    faults_prefect.SERVER.close()
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
