"""Real SGLang on this CPU through aerie's process launcher: readiness with the launch nonce, progress from
SGLang's own log lines (and the reference server's imitation of them), a stale SGLang on the port, a
kill -9 of SGLang's scheduler child, and no call into the CPU shims over the whole run.

One SGLang server serves the module (a start costs about a minute here); the tests run in file order
and the kill of its scheduler comes last but one, the shim-call check last.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from aerie.errors import PortInUseError, ServerCrashedError, ServerIdentityError
from aerie.serving import LogTail, ModelServer, ServerConfig, StartupLog, spec_for
from aerie.serving.launcher import ProcessLauncher, live_group_members
from aerie.serving.probe import Prober, port_is_free
from aerie.serving.spec import new_nonce
from tests.processes import free_port
from tests.sglang_support import cpu_config, sglang_python, shim_calls, shim_env

pytestmark = [pytest.mark.sglang, pytest.mark.integration, pytest.mark.slow]

# The startup stages SGLang 0.5.23's CPU engine logs, as aerie's progress names them, in order (no CUDA
# graphs on a CPU). The shard bar's own messages vary with the shard count and are checked apart.
CPU_STAGES = [
    "parsed server arguments",
    "initialising distributed",
    "loading weights",
    "weights loaded",
    "KV cache allocated",
    "memory pool ready",
    "scheduler ready",
    "HTTP application started",
    "HTTP server listening, warming up",
    "fired up and ready to roll",
]
STAMP = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] ")


@dataclass
class Served:
    server: ModelServer
    calls: Path
    events: list[tuple[float, str]] = field(default_factory=list)

    @property
    def launcher(self) -> ProcessLauncher:
        assert isinstance(self.server.launcher, ProcessLauncher)
        return self.server.launcher


@pytest.fixture(scope="module")
def served(smollm2, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("sglang-server")
    calls = work / "shim-calls.txt"
    cfg = cpu_config(free_port(), calls, startup_timeout_s=900)
    spec = spec_for(cfg, model_path=smollm2.path, name="sglang-cpu", log_path=work / "server.log")
    run = Served(server=ModelServer(spec), calls=calls)
    run.server.progress = lambda fraction, message: run.events.append((fraction, message))
    run.server.start()
    try:
        yield run
    finally:
        run.server.stop()


def stages(messages: list[str]) -> list[str]:
    """Progress messages less the shard bar's (their counts depend on the checkpoint's shards)."""
    return [m for m in messages if not m.startswith("weights: shard")]


def stage_lines(path: Path) -> dict[str, str]:
    """Each startup stage a whole log shows, as aerie's parser names it, with its first line. Each piece
    is read on its own: the live progress never goes back, so a stage logged after a later one (SGLang
    prints "fired up" and uvicorn's "running on" from two threads, in either order) is not in it."""
    lines: dict[str, str] = {}
    for piece in LogTail(path).drain():
        event = StartupLog().feed(piece)
        if event is not None and event.message in CPU_STAGES:
            lines.setdefault(event.message, piece.strip())
    return lines


def words(line: str) -> str:
    """A log line's fixed words: after the timestamp, up to its first value (a number or `=`)."""
    return re.split(r"[=\d]", STAMP.sub("", line), maxsplit=1)[0]


def test_real_sglang_is_ready_once_it_serves_and_echoes_this_launchs_nonce(served: Served) -> None:
    server = served.server
    assert server.health_endpoint == "/health_generate" and server.identity_endpoint == "/server_info"
    assert server.info["weight_version"] == server.spec.weight_version
    reply = httpx.post(
        server.url + "/generate",
        json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        timeout=120,
        trust_env=False,
    )
    assert reply.status_code == 200 and reply.json()["text"].strip(), reply.text
    # The readiness check's identity step, against the same real server, for a launch with another
    # nonce: a healthy SGLang that is not that launch is not "ready".
    other = ModelServer(server.spec.with_(nonce=new_nonce()))
    prober = Prober(server.url)
    try:
        with pytest.raises(ServerIdentityError, match="is not the one launched") as err:
            other._verify_identity(prober)
    finally:
        prober.close()
    assert server.spec.weight_version in str(err.value) and other.spec.weight_version in str(err.value)


def test_progress_follows_sglangs_own_log_lines(served: Served) -> None:
    fractions = [f for f, _ in served.events]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    seen = [m for _, m in served.events]
    live = [m for m in seen if m in CPU_STAGES]
    assert live == [m for m in CPU_STAGES if m in live], seen  # in SGLang's order, never backwards
    assert {"loading weights", "weights loaded", "KV cache allocated", "fired up and ready to roll"} <= set(
        live
    )
    assert any(m.startswith("weights: shard 1/1") for m in seen), seen
    # Every stage is in SGLang's log, each line in its format (`[date time] words`).
    lines = stage_lines(served.server.spec.log_path)
    assert set(lines) == set(CPU_STAGES), lines
    assert all(STAMP.match(line) for line in lines.values()), lines


def test_the_reference_servers_imitation_of_the_log_parses_the_same_way(
    served: Served, smollm2, tmp_path: Path
) -> None:
    sglang = stage_lines(served.server.spec.log_path)
    spec = spec_for(
        ServerConfig(device="cpu", port=free_port(), startup_timeout_s=600),
        model_path=smollm2.path,
        log_path=tmp_path / "reference.log",
    )
    with ModelServer(spec):
        pass
    reference = stage_lines(spec.log_path)
    # Every stage SGLang's CPU engine logs, the reference server logs too, but one: it is one process,
    # with no distributed start (SGLang's "Init parallel begin.") to report.
    assert set(sglang) - set(reference) == {"initialising distributed"}, (sglang, reference)
    assert set(reference) <= set(sglang), (sglang, reference)
    # Each in SGLang's line format: the same timestamp prefix, the same words up to the first value.
    for stage, ours in reference.items():
        theirs = sglang[stage]
        assert bool(STAMP.match(ours)) == bool(STAMP.match(theirs)), (ours, theirs)
        assert words(ours) == words(theirs), (ours, theirs)


def test_a_stale_sglang_on_the_port_is_refused_and_named(served: Served, smollm2, tmp_path: Path) -> None:
    port = served.server.spec.port
    cfg = cpu_config(port, tmp_path / "calls.txt")
    second = ModelServer(spec_for(cfg, model_path=smollm2.path, log_path=tmp_path / "second.log"))
    with pytest.raises(PortInUseError) as err:
        second.start()
    message = str(err.value)
    assert f"port {port}" in message and f"weight_version='{served.server.spec.weight_version}'" in message
    assert f"pid {served.launcher.pid}" in message, message
    assert not (tmp_path / "second.log").exists()  # nothing was launched
    served.server.check_alive()  # and the server on the port was left alone


def test_a_killed_scheduler_child_is_reported_within_two_seconds(served: Served) -> None:
    server, launcher = served.server, served.launcher
    assert launcher.pid is not None
    children = psutil.Process(launcher.pid).children(recursive=True)
    schedulers = [c for c in children if c.name() == "sglang::scheduler"]
    assert len(schedulers) == 1, [(c.pid, c.name()) for c in children]
    scheduler = schedulers[0]
    killed_at = time.monotonic()
    scheduler.kill()  # SIGKILL to the child; SGLang's HTTP process lives on
    crash: ServerCrashedError | None = None
    while crash is None and time.monotonic() - killed_at < 30:
        try:
            server.check_alive(settle_s=0)
        except ServerCrashedError as exc:
            crash = exc
        time.sleep(0.01)
    reported_s = time.monotonic() - killed_at
    assert crash is not None and server.crash_detected_at is not None, server.log_tail()
    detected_s = server.crash_detected_at - killed_at
    print(f"scheduler kill -9 seen after {detected_s:.3f} s, reported after {reported_s:.3f} s")
    assert reported_s <= 2.0, f"the kill -9 of the scheduler was reported after {reported_s:.3f} s"
    with pytest.raises(ServerCrashedError) as err:
        server.check_alive()
    message = str(err.value)
    assert err.value.after_ready and f"pid {scheduler.pid} (sglang::scheduler)" in message, message
    assert "last lines of" in message and "  | " in message, message
    # The cause is the scheduler's death (SGLang's own crash line once it has logged it), not a line
    # SGLang logged earlier and survived (a failed post-warm-up call at start-up).
    cause = message.split("\ncause: ", 1)[1].splitlines()[0]
    assert "scheduler" in cause and "freeze_gc" not in cause, cause
    # The server that can no longer answer is ended at once, not after SGLang's own diagnostics.
    deadline = time.monotonic() + 10
    while launcher.group_members() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert launcher.group_members() == [], [psutil.Process(p).name() for p in launcher.group_members()]


def test_no_shim_was_called_over_the_whole_run(served: Served) -> None:
    served.server.stop()
    assert served.server.spec.env["AERIE_SHIM_CALLS_FILE"] == str(served.calls)
    assert served.calls.exists() and shim_calls(served.calls) == []
    assert live_group_members(served.launcher.pgid or 0) == []
    assert port_is_free("127.0.0.1", served.server.spec.port)


def test_a_call_into_a_shim_is_recorded_and_raises(tmp_path: Path) -> None:
    """The record the test above reads is real: SGLang's interpreter calling a shim leaves a line."""
    calls = tmp_path / "calls.txt"
    code = "import sgl_kernel\ntry:\n    sgl_kernel.copy_all_layer_kv_cache_cpu(1)\nexcept RuntimeError as e:\n    print(e)"
    done = subprocess.run(
        [sglang_python(), "-c", code], env=shim_env(calls), capture_output=True, text=True, timeout=120
    )
    assert "is a CPU test shim" in done.stdout, done.stderr
    assert [line.split()[1] for line in shim_calls(calls)] == ["sgl_kernel.copy_all_layer_kv_cache_cpu"]
