"""The fault matrix's generation cases (tests/faults/matrix.py): faults injected into a generation run
against the local fault server (tests/fault_server.py), each case proving its fault fired by the
server's own count of faulted answers (or the injector's: a signal's exit status, a kill), then the
run repeated without it and its output compared, conversation by conversation, with an unfaulted run's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aerie.datasets import SourceSpec
from aerie.errors import AerieError, StoreError
from aerie.generate.config import DatasetSpec, EndpointConfig, GenerateConfig, SamplingParams
from aerie.generate.work import run as generate
from aerie.manifest import StageResult
from aerie.store import ArtifactStore, LocalStore
from tests.fault_check import Snapshot, Verdict, compare, generation_snapshot
from tests.fault_server import IN_BAND_ERROR, OK, REASONING_ONLY, Fault, FaultServer, slow, status
from tests.faults.case import ROOT, Case, first_line, wait_until
from tests.stage_work import dataset_dir

API_KEY = "sk-aerie-fault-matrix-secret-0123456789"
KEY_ENV = "AERIE_FAULTS_API_KEY"
N = 24  # conversations per generation case


def write_source(path: Path, n: int = N, edit: dict[int, str] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            question = (edit or {}).get(i, f"question {i}")
            f.write(json.dumps({"id": f"c{i:03d}", "conversations": [{"from": "human", "value": question}]}))
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
        source=SourceSpec(kind="jsonl", path=str(work / "source.jsonl")),
        sampling=SamplingParams(max_tokens=8),
    )
    if not (work / "source.jsonl").exists():
        write_source(work / "source.jsonl")
    return cfg, spec


def served(server: FaultServer, pred: Callable[[Any], bool]) -> int:
    """Answers the fault server sent whose fault matches `pred` (POSTs and, where it counts them, GETs)."""
    return sum(1 for s in [*server.seen, *getattr(server, "gets", [])] if pred(s.fault))


def with_code(code: int) -> Callable[[Any], bool]:
    return lambda f: f.status == code


def output_snapshot(work: Path, store: ArtifactStore, result: StageResult, url: str) -> Snapshot:
    """The finished stage's output (downloaded from any store) and, on a local store, its journal."""
    out = Path(tempfile.mkdtemp(dir=work, prefix="out-"))
    for name in ("conversations.parquet", "manifest.json"):
        store.get_file(f"{result.prefix}/{name}", out / name)
    journal = None
    if isinstance(store, LocalStore):
        journal = Path(store.root) / result.prefix.rsplit("/", 1)[0] / "journal"
    return generation_snapshot(out, journal, subs_for(work, url))


def subs_for(work: Path, url: str, *more: tuple[str, str]) -> list[tuple[str, str]]:
    # Longest first: an unfaulted run's folder sits inside its case's.
    return [*more, (url, "<endpoint>"), (str(work), "<work>")]


def unfaulted(work: Path, edit: dict[int, str] | None = None, n: int = N) -> Snapshot:
    """The same generation with no fault, in its own folder and server: what every case must equal."""
    home = work / "unfaulted"
    write_source(home / "source.jsonl", n=n, edit=edit)
    saved = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = API_KEY
    try:
        with FaultServer(api_key=API_KEY) as server:
            cfg, spec = gen_setup(home, server.url)
            store = LocalStore(home / "store")
            result = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
            return output_snapshot(home, store, result, server.url)
    finally:
        if saved is None:
            os.environ.pop(KEY_ENV, None)
        else:
            os.environ[KEY_ENV] = saved


def judged(work: Path, store: ArtifactStore, final: StageResult, url: str, **edit: Any) -> Verdict:
    return compare(unfaulted(work, **edit), output_snapshot(work, store, final, url))


def fault_then_rerun(
    work: Path,
    plan: Callable[[FaultServer], None],
    fired: Callable[[FaultServer], tuple[int, str]],
    *,
    expect_error: bool,
    fix: Callable[[FaultServer], None] = lambda s: None,
    env_key: str = API_KEY,
) -> Case:
    """One HTTP fault: run with the fault planned, then (after `fix`) again; `fired` counts the faulted
    answers the server sent (a case whose count is 0 did not test anything and fails)."""
    os.environ[KEY_ENV] = env_key
    store = LocalStore(work / "store")
    with FaultServer(api_key=API_KEY) as server:
        cfg, spec = gen_setup(work, server.url)
        plan(server)
        began = time.monotonic()
        detect: float | None = None
        try:
            generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
            message = "absorbed: the run finished"
        except AerieError as exc:
            detect = time.monotonic() - began
            message = first_line(exc)
        count, what = fired(server)
        os.environ[KEY_ENV] = API_KEY
        fix(server)
        final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
        verdict = judged(work, store, final, server.url)
    leak = API_KEY in message or env_key in message
    ok = (detect is not None) == expect_error and not leak
    if leak:
        message += " [the API key is in this message]"
    return Case.of(count > 0, f"{count} {what}", detect, verdict, message, ok)


def case_429_storm(work: Path) -> Case:
    def plan(s: FaultServer) -> None:
        s.plan = {f"question {i}": [status(429, retry_after="0.05")] * 3 for i in range(N)}

    return fault_then_rerun(
        work, plan, lambda s: (served(s, with_code(429)), "HTTP 429 served"), expect_error=False
    )


def case_5xx_storm(work: Path) -> Case:
    def plan(s: FaultServer) -> None:
        s.plan = {f"question {i}": [status(500), status(502), status(503)] for i in range(N)}

    return fault_then_rerun(
        work, plan, lambda s: (served(s, lambda f: f.status >= 500), "HTTP 5xx served"), expect_error=False
    )


def case_http_200_error(work: Path) -> Case:
    def plan(s: FaultServer) -> None:
        s.plan = {f"question {i}": [IN_BAND_ERROR, IN_BAND_ERROR] for i in range(0, N, 2)}

    return fault_then_rerun(
        work,
        plan,
        lambda s: (served(s, lambda f: f == IN_BAND_ERROR), "HTTP 200 answers carrying an error served"),
        expect_error=False,
    )


def case_401(work: Path) -> Case:
    return fault_then_rerun(
        work,
        lambda s: None,
        lambda s: (served(s, with_code(401)), "HTTP 401 served (a wrong key)"),
        expect_error=True,
        env_key="sk-wrong-key-not-to-be-printed",
    )


def case_402(work: Path) -> Case:
    def plan(s: FaultServer) -> None:
        s.default = status(402, body='{"error": {"message": "Insufficient credits"}}')

    def fix(s: FaultServer) -> None:
        s.default = OK

    return fault_then_rerun(
        work, plan, lambda s: (served(s, with_code(402)), "HTTP 402 served"), expect_error=True, fix=fix
    )


def case_empty_answers(work: Path) -> Case:
    def plan(s: FaultServer) -> None:
        s.plan = {f"question {i}": [REASONING_ONLY] for i in range(0, N, 6)}

    def fix(s: FaultServer) -> None:
        s.plan = {}  # e.g. max_tokens raised: the model now answers after its reasoning

    return fault_then_rerun(
        work,
        plan,
        lambda s: (served(s, lambda f: f == REASONING_ONLY), "answers with reasoning only served"),
        expect_error=True,
        fix=fix,
    )


CHILD = """
import resource, signal, sys
from aerie.generate.config import DatasetSpec, GenerateConfig
from aerie.generate.work import run
from aerie.store import LocalStore
from tests.stage_work import dataset_dir
if len(sys.argv) > 5:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limit = int(sys.argv[5])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
cfg = GenerateConfig.model_validate_json(sys.argv[1])
spec = DatasetSpec.model_validate_json(sys.argv[2])
run(cfg, spec, dataset_dir(LocalStore(sys.argv[3]), "r", cfg, spec), base_url=sys.argv[4])
"""


def gen_child(
    cfg: GenerateConfig, spec: DatasetSpec, store_root: Path, url: str, *extra: str
) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", CHILD, cfg.model_dump_json(), spec.model_dump_json(), str(store_root), url]
    return subprocess.Popen(
        [*argv, *extra],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def journal_ids(store_root: Path, run: str = "r") -> list[str]:
    out = []
    for part in sorted((store_root / run / "generate-toy" / "journal").rglob("part-*.jsonl")):
        for line in part.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError):
                continue
    return out


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
        store = LocalStore(store_root)
        final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
        verdict = judged(work, store, final, server.url)
    # Fired: the signal ended the child (not a normal exit) before it had journaled every conversation.
    fired = child.returncode in (-sig, 128 + sig) and before < N
    message = (
        f"child exited {child.returncode}; {before} of {N} conversations journaled before the signal kept, "
        "the re-run generated the rest"
    )
    return Case.of(fired, f"{sig.name} delivered at {before} of {N} journaled", None, verdict, message)


def case_fault_server_killed(work: Path) -> Case:
    """The endpoint's process dies mid-run (kill -9); it comes back on the same port; the re-run resumes."""
    from tests.processes import free_port, stop

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
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=url)
        except Exception as exc:
            out["error"] = exc
        out["ended"] = time.monotonic()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    wait_until(lambda: len(journal_ids(store_root)) >= 4, 60)
    at_kill = len(set(journal_ids(store_root)))
    killed = time.monotonic()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    thread.join(120)
    error = out.get("error")
    detect = out["ended"] - killed if error is not None else None
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    proc.stdout.readline()
    try:
        final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=url)
    finally:
        stop(proc)
    verdict = judged(work, store, final, url)
    message = first_line(error) if error else "no error: the run finished before the kill"
    fired = proc.returncode is not None and at_kill < N
    return Case.of(
        fired,
        f"endpoint SIGKILLed at {at_kill} of {N} journaled",
        detect,
        verdict,
        message,
        error is not None,
    )


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
            (err.strip().splitlines() or [""])[-1],
        )
        store = LocalStore(store_root)
        final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
        verdict = judged(work, store, final, server.url)
    fired = "File too large" in err  # the file-size limit refused a journal write
    return Case.of(fired, "a journal write refused (EFBIG)", detect, verdict, line, child.returncode != 0)


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
            generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
        except StoreError as exc:
            detect, message = time.monotonic() - began, first_line(exc)
        overlapped = child.poll() is None  # the first was still writing when the second was refused
        child.wait(120)
        final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
        verdict = judged(work, store, final, server.url)
    ok = detect is not None and child.returncode == 0 and final.cache_hit
    return Case.of(overlapped, "a second run started while the first wrote", detect, verdict, message, ok)


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
            generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
        except AerieError as exc:
            detect, message = time.monotonic() - began, first_line(exc)
        asked = len(server.seen)
        path.write_text(good)  # fixed in place
        final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
        verdict = judged(work, store, final, server.url)
    fired = f"{N} of {N}" in message
    ok = detect is not None and asked == 0 and not final.cache_hit
    return Case.of(fired, f"{N} of {N} records unreadable", detect, verdict, message, ok)


def case_edited_prompt(work: Path) -> Case:
    """A source edited in place between two runs: only the edited conversation is asked again, and the
    output equals an unfaulted run on the edited source (no stale answer kept)."""
    os.environ[KEY_ENV] = API_KEY
    store = LocalStore(work / "store")
    edit = {5: "question 5, reworded"}
    with FaultServer(api_key=API_KEY) as server:
        cfg, spec = gen_setup(work, server.url)
        generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
        asked = len(server.seen)
        write_source(work / "source.jsonl", edit=edit)  # in place: same path, same ids
        final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
        again = [s.prompt for s in server.seen[asked:]]
        verdict = judged(work, store, final, server.url, edit=edit)
    manifest = json.loads(store.get_bytes(f"{final.prefix}/manifest.json"))
    counts = {k: manifest.get("counts", {}).get(k) for k in ("reused", "regenerated", "changed")}
    ok = again == [edit[5]] and counts == {"reused": N - 1, "regenerated": 1, "changed": 1}
    message = f"the re-run asked {len(again)} prompt(s) {again[:3]}; manifest counts {counts}"
    return Case.of(edit[5] in again, "1 prompt edited in place", None, verdict, message, ok)


def cli_generate(work: Path, url: str, *extra: str) -> list[str]:
    """`aerie run smollm2-local --until generate` on the toy source against `url`, as a user runs it."""
    aerie = Path(sys.executable).parent / "aerie"
    return [
        str(aerie),
        "run",
        "smollm2-local",
        f"store.uri={work / 'store'}",
        "run=r",
        f"generate.endpoint.base_url={url}",
        f"generate.endpoint.api_key_env={KEY_ENV}",
        "generate.endpoint.concurrency=4",
        "generate.endpoint.max_retries=0",
        "generate.endpoint.read_timeout_s=900",
        f"generate.datasets=[{{name: toy, source: {{kind: jsonl, path: {work / 'source.jsonl'}}}, "
        "sampling: {max_tokens: 8}}]",
        *extra,
        "--until",
        "generate",
    ]


def cli_output(work: Path) -> Path:
    (manifest,) = sorted((work / "store" / "r" / "generate-toy").glob("*/manifest.json"))
    return manifest.parent


def case_ctrl_c(work: Path) -> Case:
    """SIGINT (Ctrl-C) while answers that would take 10 minutes are in flight: the command exits within
    seconds, one line saying what is kept, no traceback; the same command then completes."""
    os.environ[KEY_ENV] = API_KEY
    write_source(work / "source.jsonl")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with FaultServer(api_key=API_KEY) as server:
        server.plan = {"question 0": [slow(600)], "question 1": [slow(600)]}
        child = subprocess.Popen(
            cli_generate(work, server.url), cwd=work, stderr=subprocess.PIPE, text=True, env=env
        )
        wait_until(
            lambda: len(server.requests_for("question 0") + server.requests_for("question 1")) >= 2, 120
        )
        wait_until(lambda: len(server.seen) >= N, 60)  # every other answer sent: only the slow two in flight
        in_flight = 2
        child.send_signal(signal.SIGINT)
        sent = time.monotonic()
        try:
            _, err = child.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            _, err = child.communicate()
        exit_s = time.monotonic() - sent
        last = (err.strip().splitlines() or [""])[-1]
        again = subprocess.run(
            cli_generate(work, server.url), cwd=work, capture_output=True, text=True, env=env
        )
        store = LocalStore(work / "store")
        out = cli_output(work)
        snap = generation_snapshot(out, out.parent / "journal", subs_for(work, server.url))
    with FaultServer(api_key=API_KEY) as clean:
        home = work / "unfaulted"
        write_source(home / "source.jsonl")
        subprocess.run(
            cli_generate(home, clean.url), cwd=home, capture_output=True, text=True, env=env, check=True
        )
        want = generation_snapshot(cli_output(home), None, subs_for(home, clean.url))
    del store
    verdict = compare(want, snap)
    ok = child.returncode == 130 and "Traceback" not in err and "kept" in last and again.returncode == 0
    message = (
        f"exit {child.returncode} {exit_s:.2f} s after SIGINT: {last[:240]}; re-run exit {again.returncode}"
    )
    return Case.of(
        in_flight == 2 and child.returncode is not None,
        "SIGINT with 2 answers in flight",
        exit_s,
        verdict,
        message,
        ok,
    )


def lan_address() -> str | None:
    """This machine's address on its network (not loopback), or None: where plain HTTP is insecure."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def case_insecure_url(work: Path) -> Case:
    """Endpoint URLs a user mistypes: `htps://` and no scheme (refused at load), and plain http to a host
    on the network, where the key would travel in clear text (refused before any request). The insecure
    one is served by a real server on this machine's network address: it proves no request reached it,
    and, allowed explicitly, that the same run does reach it (the fault is live)."""
    from aerie.errors import ConfigError
    from aerie.presets import load_config

    os.environ[KEY_ENV] = API_KEY
    write_source(work / "source.jsonl")
    host = lan_address()
    store = LocalStore(work / "store")
    with FaultServer(api_key=API_KEY).start(host="0.0.0.0") as server:
        port = server.url.rsplit(":", 1)[1].split("/")[0]
        refused, messages, began = 0, [], time.monotonic()
        for url in (f"htps://127.0.0.1:{port}/v1", f"127.0.0.1:{port}/v1"):
            try:
                load_config("smollm2-local", cli_generate(work, url)[3:-2])
                messages.append(f"{url}: accepted at load")
            except ConfigError as exc:
                refused += 1
                messages.append(f"{url}: {first_line(exc)[-160:]}")
        insecure = f"http://{host}:{port}/v1" if host else "http://192.0.2.1:9/v1"
        try:
            cfg, spec = gen_setup(work, insecure)
            generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=insecure)
            messages.append(f"{insecure}: generated")
        except AerieError as exc:
            refused += 1
            messages.append(f"{insecure}: {first_line(exc)[:200]}")
        detect = (time.monotonic() - began) / 3
        reached = len(server.seen) + len(getattr(server, "gets", []))
        control, sent, verdict = "no network address here: the allowed run not tried", 0, Verdict()
        if host:
            cfg, spec = gen_setup(work, insecure, allow_insecure=True)
            final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=insecure)
            sent = sum(1 for s in server.seen if s.authorization == f"Bearer {API_KEY}")
            control = f"allowed explicitly, the same URL got {sent} requests carrying the key"
            verdict = compare(unfaulted(work), output_snapshot(work, store, final, insecure))
    ok = refused == 3 and reached == 0 and API_KEY not in " ".join(messages)
    message = f"{refused} of 3 refused, {reached} requests reached the server; {control} | " + " | ".join(
        messages
    )
    # Fired: the insecure URL really led to a server that takes the key (the explicitly allowed run).
    return Case.of(
        sent > 0, "2 malformed URLs, 1 plain-http URL to a network host", detect, verdict, message, ok
    )


# -- inputs and endpoints a new user meets ------------------------------------------------------------


def case_lone_surrogate(work: Path) -> Case:
    """A source line holding a lone surrogate escape (`"\\ud800"`, half an emoji, as scraped chat dumps
    have): generation must go on, the half emoji replaced by U+FFFD and counted; the output equals an
    unfaulted run's whose source held U+FFFD there in the first place."""
    os.environ[KEY_ENV] = API_KEY
    source = write_source(work / "source.jsonl", edit={5: "question 5 \ud800 half an emoji"})
    held = "\\ud800" in source.read_text()  # the JSON escape itself, as the scraped line has it
    store = LocalStore(work / "store")
    detect, message, got, repaired = None, "", Snapshot(), 0
    with FaultServer(api_key=API_KEY) as server:
        cfg, spec = gen_setup(work, server.url)
        began = time.monotonic()
        try:
            final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
            got = output_snapshot(work, store, final, server.url)
            loader = got.manifests["generate"].get("loader", {})
            repaired = int(loader.get("repaired", {}).pop("lone_surrogate_replaced", 0))
            message = f"absorbed: {repaired} conversation repaired (U+FFFD), the run finished"
        except Exception as exc:  # what a user saw: the product's own error or a traceback's last line
            detect, message = time.monotonic() - began, f"{type(exc).__name__}: {first_line(exc)}"
        asked = sum(1 for s in server.seen if "\ufffd" in s.prompt)
    verdict = compare(unfaulted(work, edit={5: "question 5 \ufffd half an emoji"}), got)
    message += f"; {asked} request(s) carried U+FFFD"
    return Case.of(
        held, 'a lone surrogate ("\\ud800") in one source line', detect, verdict, message, repaired == 1
    )


def case_redirect_307(work: Path) -> Case:
    """An endpoint answering 307 (moved elsewhere): not followed (the key would travel to another host),
    refused at once as a redirect naming where it points, not blamed on the model; fixed, the re-run
    equals an unfaulted run."""
    moved = Fault(status=307, location="https://elsewhere.example/v1/chat/completions", raw_body=b"")

    def plan(s: FaultServer) -> None:
        s.default = moved
        s.get_fault = moved

    def fix(s: FaultServer) -> None:
        s.default, s.get_fault = OK, None

    case = fault_then_rerun(
        work, plan, lambda s: (served(s, with_code(307)), "HTTP 307 served"), expect_error=True, fix=fix
    )
    named = "redirect" in case.message.lower() and "elsewhere.example" in case.message
    case.handled = case.handled and named and case.detect_s is not None and case.detect_s < 15
    case.survived = case.fired and case.handled and case.survived
    return case


HTML_PAGE = b"<!DOCTYPE html><html><head><title>Sign in</title></head><body>Please log in</body></html>"


def case_html_200(work: Path) -> Case:
    """An endpoint whose answers are 200 with an HTML login page (its model list passes): stopped at once, naming the content type and
    the body's start (no 40-50 s of retries); fixed, the re-run equals an unfaulted run."""
    page = Fault(content_type="text/html; charset=utf-8", raw_body=HTML_PAGE)

    def plan(s: FaultServer) -> None:
        s.default = page  # the check before generation (a GET) passes: the answers are the pages

    def fix(s: FaultServer) -> None:
        s.default = OK

    case = fault_then_rerun(
        work,
        plan,
        lambda s: (served(s, lambda f: f == page), "HTML pages served with HTTP 200"),
        expect_error=True,
        fix=fix,
    )
    named = "text/html" in case.message and "Sign in" in case.message
    case.handled = case.handled and named and case.detect_s is not None and case.detect_s < 15
    case.survived = case.fired and case.handled and case.survived
    return case
