"""The fault matrix's reference-server cases (tests/faults/matrix.py): a generation run against a real
reference server (SmolLM2-135M on the CPU) told to fail through `AERIE_REFSERVER_FAULTS`
(aerie/engine/server/faults.py), then compared, conversation by conversation, with the same run against
a server without faults on the same port:

- an allocation failure while the KV cache grows (`kv_alloc`, raised as `torch.OutOfMemoryError`, as a
  full device does): the server drops its cache and graphs, requeues the batch and answers on;
- decoding steps that keep failing (`step`): the server reports itself unhealthy (/health 503), the
  serving watch ends it, and the run, re-run against a fresh server, completes.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import httpx

from aerie.errors import AerieError
from aerie.generate.config import GenerateConfig
from aerie.generate.work import run as generate
from aerie.serving import ModelServer, ServerConfig, spec_for
from aerie.store import LocalStore
from tests.fault_check import compare
from tests.faults import generation as gen
from tests.faults.case import Case, first_line
from tests.processes import free_port
from tests.stage_work import dataset_dir

FAULTS_ENV = "AERIE_REFSERVER_FAULTS"
N = 8  # conversations: a batch of concurrent requests grows the KV cache


def server(work: Path, port: int, name: str, faults: str = "", *args: str) -> ModelServer:
    from aerie.targets import resolve_target

    cfg = ServerConfig(
        backend="reference",
        port=port,
        device="cpu",
        grace_s=15.0,
        poll_interval_s=0.2,
        env={FAULTS_ENV: faults} if faults else {},
        extra_args=["--dtype", "float32", "--random-seed", "0", *args],
    )
    target = resolve_target("smollm2-135m-instruct")
    return ModelServer(spec_for(cfg, model_path=target.path, log_path=work / f"{name}.log"))


def v1(server: ModelServer) -> str:
    return f"{server.url}/v1"


def setup(home: Path, url: str) -> tuple[GenerateConfig, Any]:
    gen.write_source(home / "source.jsonl", n=N)
    cfg, spec = gen.gen_setup(home, url, read_timeout_s=300.0, connect_timeout_s=10.0, max_retries=3)
    return cfg, spec


def server_info(url: str) -> dict[str, Any]:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        info = httpx.get(f"{url}/server_info", timeout=30).json()
        return info if isinstance(info, dict) else {}
    return {}


def unfaulted_on(work: Path, url: str) -> Any:
    """The same generation in its own folder against a server without faults."""
    home = work / "unfaulted"
    cfg, spec = setup(home, url)
    store = LocalStore(home / "store")
    result = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=url)
    return gen.output_snapshot(home, store, result, url)


def case_oom_in_step(work: Path) -> Case:
    """`kv_alloc=60:1`: the warm-up allocates one row's 60 buffers; the first batch's growth then fails
    at its first buffer."""
    os.environ[gen.KEY_ENV] = gen.API_KEY
    port = free_port()
    store = LocalStore(work / "store")
    detect, message = None, ""
    with server(work, port, "faulty", "kv_alloc=60:1") as faulty:
        cfg, spec = setup(work, v1(faulty))
        began = time.monotonic()
        try:
            final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=v1(faulty))
        except AerieError as exc:
            detect, message, final = time.monotonic() - began, first_line(exc), None
        info = server_info(faulty.url)
        log = (work / "faulty.log").read_text(errors="replace")
    state = (info.get("internal_states") or [{}])[0]
    recoveries = int(state.get("oom_recoveries", 0))
    injected = log.count(f"injected by {FAULTS_ENV} (kv_alloc)")
    with server(work, port, "clean") as clean:
        want = unfaulted_on(work, v1(clean))
    got = gen.output_snapshot(work, store, final, v1(faulty)) if final is not None else None
    verdict = compare(want, got) if got is not None else compare(want, type(want)())
    message = message or (
        f"absorbed: {recoveries} out-of-memory recovery, the server stayed healthy "
        f"(unhealthy: {info.get('unhealthy')}) and the run finished"
    )
    handled = final is not None and recoveries >= 1 and not info.get("unhealthy")
    return Case.of(
        injected >= 1,
        f"{injected} KV cache allocation(s) failed with torch.OutOfMemoryError in a step",
        detect,
        verdict,
        message,
        handled,
    )


def case_unhealthy_restarted(work: Path) -> Case:
    """`step=9:*` with `--unhealthy-after 3`: the warm-up and the first health probe pass, then every
    step fails; the third in a row turns the server unhealthy and the serving watch ends it. The run
    fails, naming the server; re-run against a fresh server on the same port, it completes."""
    from aerie.errors import ServerCrashedError

    os.environ[gen.KEY_ENV] = gen.API_KEY
    port = free_port()
    store = LocalStore(work / "store")
    detect, message, health, crash = None, "the run finished on a failing server", "", ""
    with server(work, port, "faulty", "step=9:*", "--unhealthy-after", "3") as faulty:
        cfg, spec = setup(work, v1(faulty))
        began = time.monotonic()
        try:
            generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=v1(faulty))
        except AerieError as exc:
            detect, message = time.monotonic() - began, first_line(exc)
        with contextlib.suppress(httpx.HTTPError):
            answer = httpx.get(f"{faulty.url}/health", timeout=10)
            health = f"/health {answer.status_code}"
        deadline = time.monotonic() + 20
        while faulty.crash_detected_at is None and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            faulty.check_alive()
        except ServerCrashedError as exc:
            crash = first_line(exc)
        deadline = time.monotonic() + 20  # the watch's kill lands a moment after its crash report
        while faulty.launcher.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        ended = faulty.launcher.exit_code() is not None
    log = (work / "faulty.log").read_text(errors="replace")
    unhealthy = "The reference server is unhealthy" in log
    with server(work, port, "fresh") as fresh:
        final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=v1(fresh))
        got = gen.output_snapshot(work, store, final, v1(fresh))
        want = unfaulted_on(work, v1(fresh))
    verdict = compare(want, got)
    message = (
        f"{message[:250]} | {health or 'no answer to /health'} | watch: {crash[:200] or 'no crash seen'}"
    )
    message += f" | the server process {'ended' if ended else 'still running'}; re-run on a fresh server"
    handled = detect is not None and "unhealthy" in crash and ended
    return Case.of(
        unhealthy,
        "every generation step after the warm-up failed (the server turned unhealthy)",
        detect,
        verdict,
        message,
        handled,
    )


def case_generation_server_relaunched(work: Path) -> Case:
    """The server generation launched itself (`aerie.generate.relaunch.launched`, as the pipeline's
    embedded endpoint) fails every step after its warm-up, in its first launch only
    (`AERIE_REFSERVER_FAULTS_ONCE`): it turns unhealthy, its watch ends it, and the requests failing on
    it wait for one relaunch on the same port. The run completes in one go, with nothing to re-run."""
    from aerie.generate.relaunch import launched

    os.environ[gen.KEY_ENV] = gen.API_KEY
    port = free_port()
    store = LocalStore(work / "store")
    faulty = server(work, port, "faulty", "step=9:*", "--unhealthy-after", "3").spec
    mark = work / "faulted-once"
    faulty = faulty.with_(env={**faulty.env, "AERIE_REFSERVER_FAULTS_ONCE": str(mark)})
    final, detect, message = None, None, ""
    with launched(faulty, max_restarts=2) as url:
        cfg, spec = setup(work, url)
        began = time.monotonic()
        try:
            final = generate(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=url)
        except AerieError as exc:
            detect, message = time.monotonic() - began, first_line(exc)
        got = gen.output_snapshot(work, store, final, url) if final is not None else None
    log = (work / "faulty.log").read_text(errors="replace")
    unhealthy = "The reference server is unhealthy" in log and mark.exists()
    manifest = dataset_dir(store, "r", cfg, spec).manifest() or {}
    restarts = (manifest.get("endpoint") or {}).get("server_restarts")
    with server(work, port, "clean") as clean:
        want = unfaulted_on(work, v1(clean))
    verdict = compare(want, got) if got is not None else compare(want, type(want)())
    message = message or (
        f"the server turned unhealthy, was ended by its watch and relaunched {restarts} time(s); "
        "the run finished in one go"
    )
    return Case.of(
        unhealthy,
        "every generation step of the first launch failed after its warm-up (the server turned unhealthy)",
        detect,
        verdict,
        message,
        final is not None and restarts == 1,
    )
