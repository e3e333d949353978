"""Server lifecycle against real processes: `fake_servers/sglang_like.py` starts, fails and answers the
way SGLang does, on real ports. Each fault of a bash wait loop must end in the right error with the
server's own words, and every server must be gone afterwards (process group, port, /dev/shm)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from aerie.errors import (
    CanaryError,
    ConfigError,
    PortInUseError,
    ServerCrashedError,
    ServerIdentityError,
    ServerLaunchError,
    ServerTimeoutError,
)
from aerie.serving import (
    LogTail,
    ModelServer,
    ProcessLauncher,
    ServerConfig,
    SpeculativeArgs,
    StartupLog,
    check_interpreter,
    port_is_free,
    spec_for,
    startup_deadline,
    sweep_shm,
)
from aerie.serving.launcher import check_requirement, live_group_members
from aerie.serving.spec import AERIE_ROOT, SGLANG_REQUIREMENT, Requirement
from tests.fake_servers.scenarios import fake_spec, free_port, start_stale_server
from tests.sglang_support import VERSION as SGLANG_VERSION


class Recorder:
    """A progress callback that keeps what it was told."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str]] = []

    def __call__(self, fraction: float, message: str) -> None:
        self.events.append((fraction, message))

    @property
    def messages(self) -> list[str]:
        return [m for _, m in self.events]


def assert_gone(launcher: ProcessLauncher, port: int) -> None:
    """No live process left in the server's process group, and the port can be bound again."""
    assert launcher.pgid is not None
    assert live_group_members(launcher.pgid) == []
    assert (
        not psutil.pid_exists(launcher.pgid) or psutil.Process(launcher.pgid).status() == psutil.STATUS_ZOMBIE
    )
    assert port_is_free("127.0.0.1", port)


# -- spec building ------------------------------------------------------------------------------


def test_a_target_that_needs_its_own_code_is_launched_trusting_it(tmp_path: Path) -> None:
    from aerie.engine.server.args import parse_args

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for backend in ("reference", "sglang"):
        cfg = ServerConfig(backend=backend, port=31234)  # type: ignore[arg-type]
        assert "--trust-remote-code" in spec_for(cfg, model_path=str(model), trust_remote_code=True).command
        assert "--trust-remote-code" not in spec_for(cfg, model_path=str(model)).command
    # ... and the reference server takes the flag it is given.
    ref = spec_for(ServerConfig(port=31234), model_path=str(model), trust_remote_code=True)
    assert parse_args(ref.command[3:]).trust_remote_code


def test_reference_spec_passes_the_nonce_and_the_extraction_mode(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    cfg = ServerConfig(port=31234, device="cpu", python="/opt/venv/bin/python")
    spec = spec_for(cfg, model_path=str(model), mode="extract", dump_dir=tmp_path / "dumps", nonce="abc")

    assert spec.command == [
        "/opt/venv/bin/python", "-m", "aerie.engine", "--model-path", str(model), "--port", "31234",
        "--host", "127.0.0.1", "--weight-version", "run-abc", "--mode", "extract",
        "--dump-dir", str((tmp_path / "dumps").resolve()), "--device", "cpu",
    ]  # fmt: skip
    assert spec.module == "aerie.engine" and spec.interpreter == "/opt/venv/bin/python"
    assert spec.weight_version == "run-abc" and spec.url == "http://127.0.0.1:31234"
    assert spec.image is None
    # 1000 bytes of weights: the deadline is the fixed part plus 1000 B at 200 MB/s.
    assert spec.startup_timeout_s == pytest.approx(startup_deadline(1000, "reference"))
    assert (
        spec_for(cfg.model_copy(update={"startup_timeout_s": 7.0}), model_path=str(model)).startup_timeout_s
        == 7.0
    )


def test_deadline_grows_with_the_model_size() -> None:
    kimi_int4 = 595 * 10**9
    assert startup_deadline(kimi_int4, "sglang") == pytest.approx(600 + 595e9 / 200e6)
    assert startup_deadline(kimi_int4, "sglang") > 15 * 60  # a fixed 15-minute ceiling is too short
    assert startup_deadline(None, "sglang") == 3600


def test_sglang_extraction_spec_in_docker(tmp_path: Path) -> None:
    model = tmp_path / "kimi"
    model.mkdir()
    cfg = ServerConfig(
        backend="sglang", launcher="docker", tp_size=8, image=f"lmsysorg/sglang:v{SGLANG_VERSION}", port=30000
    )
    spec = spec_for(
        cfg,
        model_path=str(model),
        mode="extract",
        dump_dir=tmp_path / "dumps",
        nonce="n1",
        model_size_bytes=10**9,
        extra_args=["--trust-remote-code"],
    )
    cmd = spec.command
    assert cmd[:3] == ["python3", "-m", "aerie.sglang_plugin.launch"]
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"  # listens on every interface inside the container
    assert cmd[cmd.index("--weight-version") + 1] == "run-n1"
    assert cmd[cmd.index("--tp-size") + 1] == "8"
    assert cmd[cmd.index("--chunked-prefill-size") + 1] == "-1"
    assert {"--skip-tokenizer-init", "--disable-radix-cache", "--trust-remote-code"} <= set(cmd)
    assert spec.host == "127.0.0.1"  # the host side of the published port stays local
    assert spec.env["AERIE_DUMP_DIR"] == str((tmp_path / "dumps").resolve())
    assert "127.0.0.1" in spec.env["no_proxy"]
    assert spec.volumes[str(model.resolve())] == str(model.resolve())
    assert str(model.resolve()) in spec.read_only_volumes
    assert spec.gpus == -1 and spec.shm_size == "32g" and spec.ipc_mode == "host"
    # The plugin launcher is swappable; serving uses SGLang's own entry point, with EAGLE-3 args.
    swapped = spec_for(cfg, model_path=str(model), mode="extract", module="my.launcher")
    assert swapped.command[2] == "my.launcher" and swapped.module == "my.launcher"
    serve = spec_for(cfg, model_path="org/model", speculative=SpeculativeArgs("/d", num_steps=3))
    assert serve.command[2] == "sglang.launch_server" and "--skip-tokenizer-init" not in serve.command
    assert serve.command[-6:] == [
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d", "--speculative-num-steps", "3"
    ]  # fmt: skip
    assert serve.startup_timeout_s == 3600  # a hub id not on local disk: size unknown


def test_the_extraction_launcher_keeps_the_pythonpath_sglang_was_found_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An SGLang installed with `pip install --target DIR` is reached only through PYTHONPATH: the
    # extraction launch adds aerie's root after it instead of replacing it.
    monkeypatch.setenv("PYTHONPATH", f"/opt/sgl{os.pathsep}/opt/site")
    cfg = ServerConfig(backend="sglang", device="cuda", python="/usr/bin/python3", port=31235)
    spec = spec_for(cfg, model_path="m", mode="extract", dump_dir=tmp_path / "dumps")
    assert spec.env["PYTHONPATH"].split(os.pathsep) == ["/opt/sgl", "/opt/site", str(AERIE_ROOT)]
    # A PYTHONPATH the server's own environment sets is the one it gets.
    own = spec_for(cfg.model_copy(update={"env": {"PYTHONPATH": "/shims"}}), model_path="m", mode="extract")
    assert own.env["PYTHONPATH"].split(os.pathsep) == ["/shims", str(AERIE_ROOT)]


def test_sglang_on_the_cpu_gets_its_cpu_engine_and_flags(tmp_path: Path) -> None:
    cfg = ServerConfig(
        backend="sglang",
        device="cpu",
        python="/opt/sglang/bin/python",
        port=31234,
        env={"PYTHONPATH": "/shims"},
        extra_args=["--max-total-tokens", "4096"],
    )
    spec = spec_for(cfg, model_path="m", mode="extract", dump_dir=tmp_path / "dumps")
    cmd = spec.command
    assert cmd[:3] == ["/opt/sglang/bin/python", "-m", "aerie.sglang_plugin.launch"]
    assert spec.env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert cmd[cmd.index("--device") + 1] == "cpu"
    assert cmd[cmd.index("--attention-backend") + 1] == "torch_native"
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.3"
    assert cmd[cmd.index("--cuda-graph-backend-decode") + 1] == "disabled"
    assert cmd[cmd.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    assert "--skip-server-warmup" in cmd
    # A CPU default the configuration gives itself is replaced, not given twice.
    assert cmd.count("--max-total-tokens") == 1 and cmd[cmd.index("--max-total-tokens") + 1] == "4096"
    # The extraction launcher is aerie's: SGLang's own environment reaches it through PYTHONPATH.
    assert spec.env["PYTHONPATH"].split(os.pathsep) == ["/shims", str(AERIE_ROOT)]
    assert spec.requires == SGLANG_REQUIREMENT and spec.requires.versions == (SGLANG_VERSION,)
    gpu = spec_for(cfg.model_copy(update={"device": "cuda", "env": {}}), model_path="m")
    assert "SGLANG_USE_CPU_ENGINE" not in gpu.env and "--device" not in gpu.command
    assert "--attention-backend" not in gpu.command and "PYTHONPATH" not in gpu.env
    docker = spec_for(cfg.model_copy(update={"launcher": "docker"}), model_path="m")
    assert docker.requires is None  # the image is pinned; its entrypoint checks its own version


@pytest.mark.integration
def test_the_interpreters_version_of_a_requirement_is_checked(tmp_path: Path) -> None:
    have = Requirement("pytest", (pytest.__version__,), setup="pip install pytest")
    assert check_requirement(sys.executable, have) == pytest.__version__
    other = Requirement("pytest", ("0.0.1",), setup="pip install pytest==0.0.1", allow_untested_env="X_OK")
    with pytest.raises(ServerLaunchError) as err:
        check_requirement(sys.executable, other)
    assert f"pytest {pytest.__version__} in" in str(err.value) and "tested pytest 0.0.1" in str(err.value)
    assert "\n" not in str(err.value)
    assert check_requirement(sys.executable, other, env={"X_OK": "1"}) == pytest.__version__
    absent = Requirement("no-such-distribution", ("1",), setup="`make setup-x` builds it")
    with pytest.raises(ServerLaunchError, match=r"^no no-such-distribution in interpreter .*make setup-x"):
        check_requirement(sys.executable, absent)
    with pytest.raises(ServerLaunchError, match=r"^no no-such-distribution environment: .*make setup-x"):
        check_requirement(str(tmp_path / "bin" / "python"), absent)


def test_reference_server_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ConfigError, match="reference server runs as a process"):
        spec_for(ServerConfig(launcher="docker"), model_path="m")
    with pytest.raises(ConfigError, match="--speculative-num-steps only"):
        spec_for(ServerConfig(), model_path="m", speculative=SpeculativeArgs("/d", eagle_topk=4))
    chain = spec_for(ServerConfig(), model_path="m", speculative=SpeculativeArgs("/d", num_steps=3))
    assert chain.command[-6:] == [
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d", "--speculative-num-steps", "3"
    ]  # fmt: skip


def test_env_values_stay_out_of_the_spec_repr() -> None:
    spec = spec_for(ServerConfig(env={"HF_TOKEN": "hf_secret"}), model_path="m")
    assert spec.env["HF_TOKEN"] == "hf_secret"
    assert "hf_secret" not in repr(spec) and "hf_secret" not in spec.describe()


# -- log parsing --------------------------------------------------------------------------------

SGLANG_STARTUP = [
    "[2026-02-01 00:05:03 TP0] Load weight begin. avail mem=78.50 GB",
    "Loading safetensors checkpoint shards:   0% Completed | 0/64 [00:00<?, ?it/s]",
    "Loading safetensors checkpoint shards:  78% Completed | 50/64 [01:23<00:20,  1.61s/it]",
    "[2026-02-01 00:07:03 TP0] Load weight end. elapsed=120.1 s, type=DeepseekV3ForCausalLM, avail mem=20 GB, mem usage=58 GB.",
    "[2026-02-01 00:07:10 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 399740, KV size: 12.1 GB",
    "[2026-02-01 00:07:11 TP0] Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, avail mem=8 GB",
    "Capturing batches (bs=512 avail_mem=7.90 GB):  40%|####      | 21/52 [00:05<00:07,  4.1it/s]",
    "[2026-02-01 00:07:40 TP0] Capture target decode CUDA graph end. bs=[1, 2, 4], elapsed=29 s, mem usage=1 GB, avail mem=7 GB.",
    "[2026-02-01 00:07:45] INFO:     Uvicorn running on http://0.0.0.0:30000 (Press CTRL+C to quit)",
    "[2026-02-01 00:07:52] The server is fired up and ready to roll!",
]


def test_sglang_startup_lines_become_monotone_progress() -> None:
    startup = StartupLog()
    events = [e for line in SGLANG_STARTUP if (e := startup.feed(line)) is not None]
    fractions = [e.fraction for e in events]
    assert fractions == sorted(fractions) and fractions[-1] == 0.99
    messages = [e.message for e in events]
    assert "weights: shard 50/64 (78%)" in messages
    assert {
        "weights loaded",
        "KV cache allocated",
        "capturing CUDA graphs (40%)",
        "fired up and ready to roll",
    } <= set(messages)
    # The drafter's second `Load weight begin` (EAGLE-3) does not move the bar back.
    assert startup.feed("[2026-02-01 00:08:00 TP0] Load weight begin. avail mem=7 GB") is None
    assert startup.fatal is None


@pytest.mark.parametrize(
    "line",
    [
        "[2026-02-01 00:09:00] Initialization failed. warmup error: AssertionError: res=<Response [502]>",
        "RuntimeError: Rank 3 scheduler died during initialization (exit code: -9)",
        "ERROR:    [Errno 98] error while attempting to bind on address ('0.0.0.0', 30000): address already in use",
    ],
)
def test_fatal_lines_are_recognised(line: str) -> None:
    startup = StartupLog()
    startup.feed(line)
    assert startup.fatal == line


def test_log_tail_splits_carriage_returns_incrementally(tmp_path: Path) -> None:
    path = tmp_path / "log"
    tail = LogTail(path)
    assert tail.read_new() == []  # no file yet: still launching
    bar = "Loading safetensors checkpoint shards: {:>3}% Completed | {}/2 [t]"
    with path.open("ab") as f:

        def write(data: str) -> list[str]:
            f.write(data.encode())
            f.flush()
            return tail.read_new()

        # tqdm draws "\r<bar>": the latest redraw has no terminator until the next one.
        assert write("first line\n\r" + bar.format(0, 0)) == ["first line", bar.format(0, 0)]
        cut = bar.format(50, 1)[:45]
        assert write("\r" + cut) == [cut]  # cut mid-write: matches no pattern, harmless
        assert write(bar.format(50, 1)[45:]) == [bar.format(50, 1)]
        assert tail.last_lines()[-1] == bar.format(50, 1)  # a stalled bar shows in the tail
        assert write("\r" + bar.format(100, 2) + "\nlast") == [bar.format(100, 2), "last"]
    assert tail.drain() == []
    # The kept tail shows the bar once (its last redraw), and the unterminated last line.
    assert tail.last_lines() == ["first line", bar.format(100, 2), "last"]


# -- /dev/shm sweep -----------------------------------------------------------------------------


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.integration
def test_shm_sweep_removes_dead_pid_segments_and_keeps_the_rest(tmp_path: Path) -> None:
    dead, live = dead_pid(), os.getpid()
    names = {
        f"sgl_shm_mm_feature_{dead}_1a2b3c4d": False,
        f"sgl_shm_ipc_{live}_5e6f7a8b": True,
        f"multi_tokenizer_args_{dead}": False,
        f"multi_tokenizer_args_{live}": True,
        "nccl-abc123": True,  # no pid in the name: never touched
        "sgl_shm_odd_name": True,
        "multi_tokenizer_args_0": True,  # pid 0 would address a process group
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = sweep_shm(tmp_path)
    assert sorted(p.name for p in removed) == sorted(n for n, keep in names.items() if not keep)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, keep in names.items() if keep)


def test_shm_sweep_can_be_limited_to_named_segments(tmp_path: Path) -> None:
    mine, other = "sgl_shm_mm_12_aaaa", "sgl_shm_mm_13_bbbb"
    for name in (mine, other):
        (tmp_path / name).write_bytes(b"x")
    # The container case: pids mean nothing here, so only what appeared during our run goes.
    removed = sweep_shm(tmp_path, only={mine}, is_alive=lambda pid: False)
    assert [p.name for p in removed] == [mine] and (tmp_path / other).exists()
    assert sweep_shm(tmp_path / "missing") == []


# -- interpreter check --------------------------------------------------------------------------


@pytest.mark.integration
def test_the_system_python_without_sglang_is_named_with_its_module() -> None:
    if not Path("/usr/bin/python3").exists():
        pytest.skip("no /usr/bin/python3 on this machine")
    with pytest.raises(ServerLaunchError) as err:
        check_interpreter("/usr/bin/python3", "sglang.launch_server")
    assert "/usr/bin/python3" in str(err.value) and "sglang.launch_server" in str(err.value)
    assert "No module named" in str(err.value)


@pytest.mark.integration
def test_missing_interpreter_and_a_working_one() -> None:
    with pytest.raises(ServerLaunchError, match=r"interpreter '/nonexistent/bin/python' not found"):
        check_interpreter("/nonexistent/bin/python", "aerie.engine")
    assert check_interpreter(sys.executable, "http.server") == sys.executable


# -- scenarios with real processes --------------------------------------------------------------


@pytest.mark.integration
def test_ready_then_teardown_leaves_nothing(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    (dumps / "batch-0").mkdir(parents=True)
    (dumps / "batch-0" / "hs.bin").write_bytes(b"x")
    spec = fake_spec(tmp_path, "--shards", "3", "--child", dump_dir=dumps, clean_dump_dir=True)
    progress = Recorder()
    seen: list[str] = []
    with ModelServer(spec, progress=progress, canary=lambda s: seen.append(s.url)) as server:
        assert server.info["weight_version"] == spec.weight_version
        assert server.identity_endpoint == "/server_info" and server.health_endpoint == "/health_generate"
        assert seen == [spec.url]  # the canary ran on the ready server
        launcher = server.launcher
        assert isinstance(launcher, ProcessLauncher) and len(launcher.group_members()) == 2
    assert "weights: shard 2/3 (67%)" in progress.messages
    assert "fired up and ready to roll" in progress.messages and progress.events[-1][0] == 1.0
    assert server.teardown is not None and server.teardown.stop is not None
    assert server.teardown.stop.exit_code == 0 and not server.teardown.stop.killed
    assert server.teardown.dump_files_removed == 1 and list(dumps.iterdir()) == []
    assert_gone(launcher, spec.port)


@pytest.mark.integration
def test_wrong_interpreter_fails_before_any_launch(tmp_path: Path) -> None:
    spec = fake_spec(tmp_path)
    spec = spec.with_(
        command=["/usr/bin/python3", "-m", "sglang.launch_server", *spec.command[3:]],
        module="sglang.launch_server",
    )
    with pytest.raises(
        ServerLaunchError, match=r"/usr/bin/python3 cannot import the server module sglang\.launch_server"
    ):
        ModelServer(spec).start()
    assert not spec.log_path.exists()  # nothing was launched, nothing was waited for
    missing = spec.with_(command=["/nonexistent/python", *spec.command[1:]])
    with pytest.raises(ServerLaunchError, match="not found"):
        ModelServer(missing).start()


@pytest.mark.integration
def test_crash_while_loading_is_reported_with_the_servers_own_error(tmp_path: Path) -> None:
    spec = fake_spec(
        tmp_path,
        "--shards",
        "3",
        "--crash-at-shard",
        "2",
        "--crash-message",
        "RuntimeError: shard 2 is corrupt (fake)",
    )
    server = ModelServer(spec)
    with pytest.raises(ServerCrashedError) as err:
        server.start()
    text = str(err.value)
    assert "exit code 1" in text
    assert "cause: RuntimeError: shard 2 is corrupt (fake)" in text
    assert "weights: shard 2/3" in text  # where it was when it died
    assert "Traceback (most recent call last)" in text  # the last log lines come along
    assert isinstance(server.launcher, ProcessLauncher)
    assert_gone(server.launcher, spec.port)


@pytest.mark.integration
def test_a_stale_server_on_the_port_is_refused_and_named(tmp_path: Path) -> None:
    port = free_port()
    stale = start_stale_server(port, tmp_path / "stale.log", weight_version="run-stale-0001")
    try:
        spec = fake_spec(tmp_path, port=port)
        with pytest.raises(PortInUseError) as err:
            ModelServer(spec).start()
        text = str(err.value)
        assert f"port {port}" in text and "GET /server_info answers 200" in text
        assert "weight_version='run-stale-0001'" in text and "model_path='fake/model'" in text
        assert not spec.log_path.exists()  # refused before launching: no false "ready"
        assert stale.poll() is None  # and the stale server is not ours to kill
    finally:
        os.killpg(stale.pid, signal.SIGKILL)
        stale.wait()


@pytest.mark.integration
def test_a_port_bound_by_something_else_is_refused_and_named(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        spec = fake_spec(tmp_path, port=sock.getsockname()[1])
        with pytest.raises(PortInUseError) as err:
            ModelServer(spec).start()
    assert "does not answer HTTP" in str(err.value) or "none of" in str(err.value)
    assert f"pid {os.getpid()}" in str(err.value)  # the owner, when the system lets us see it


@pytest.mark.integration
def test_a_server_killed_during_the_wait_is_reported(tmp_path: Path) -> None:
    spec = fake_spec(tmp_path, "--shards", "4", "--shard-seconds", "0.3", "--hang-at-shard", "2")
    server = ModelServer(spec)

    def kill_when_loading(fraction: float, message: str) -> None:
        if message.startswith("weights: shard 1/"):
            assert isinstance(server.launcher, ProcessLauncher) and server.launcher.pid is not None
            os.kill(server.launcher.pid, signal.SIGKILL)  # the OOM killer, an operator, a node drain...

    server.progress = kill_when_loading
    with pytest.raises(ServerCrashedError, match=r"killed by SIGKILL \(exit code -9\)") as err:
        server.start()
    assert "weights: shard 1/4" in str(err.value)
    assert isinstance(server.launcher, ProcessLauncher)
    assert_gone(server.launcher, spec.port)


@pytest.mark.integration
def test_a_child_keeping_the_port_after_its_parent_exits_is_named_and_ended(tmp_path: Path) -> None:
    """The main process binds, leaves a child holding the port (in its own session, deaf to SIGTERM,
    so neither the group kill nor SIGTERM reaches it) and exits. The crash names the port and the
    orphan; teardown gives no drain grace to a server that is already gone, and ends the orphan."""
    spec = fake_spec(tmp_path, "--orphan-keeps-port", grace_s=600.0)  # a grace this test would never outwait
    server = ModelServer(spec)
    with pytest.raises(ServerCrashedError) as err:
        server.start()
    text = str(err.value)
    assert "exit code 1" in text and "cause: RuntimeError: the launcher process died (fake)" in text
    orphan = int(text.split("worker pid ")[1].split()[0])  # the fake server logged its child's pid
    assert f"port {spec.port} is still held by pid {orphan} (" in text
    assert "a process this server started" in text
    report = server.teardown
    assert report is not None and report.grace_s < spec.grace_s
    # The orphan is ended by the sweep, or already by the group kill before it (both seen): either way
    # teardown leaves it gone and the port free.
    assert report.ended in ([orphan], []) and report.port_free and report.port_holders == []
    assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
    assert isinstance(server.launcher, ProcessLauncher)
    assert_gone(server.launcher, spec.port)


@pytest.mark.integration
def test_a_start_past_the_deadline_fails_with_the_last_progress(tmp_path: Path) -> None:
    spec = fake_spec(tmp_path, "--shards", "2", "--hang-at-shard", "1", startup_timeout_s=2.0)
    server = ModelServer(spec)
    with pytest.raises(ServerTimeoutError) as err:
        server.start()
    text = str(err.value)
    assert "deadline 2 s" in text and "Last progress: weights: shard 1/2 (50%)" in text
    assert "Loading safetensors checkpoint shards:  50% Completed | 1/2" in text
    assert isinstance(server.launcher, ProcessLauncher)
    assert_gone(server.launcher, spec.port)


@pytest.mark.integration
def test_a_server_echoing_another_nonce_is_rejected(tmp_path: Path) -> None:
    spec = fake_spec(tmp_path, "--report-weight-version", "run-someone-else")
    server = ModelServer(spec)
    with pytest.raises(ServerIdentityError) as err:
        server.start()
    assert "weight_version='run-someone-else'" in str(err.value) and spec.weight_version in str(err.value)
    assert isinstance(server.launcher, ProcessLauncher)
    assert_gone(server.launcher, spec.port)


@pytest.mark.integration
def test_a_fatal_startup_line_fails_even_if_the_process_lingers(tmp_path: Path) -> None:
    line = "Initialization failed. warmup error: AssertionError: res=<Response [502]>"
    spec = fake_spec(tmp_path, "--fatal-line", line)
    with pytest.raises(ServerCrashedError, match="reported a fatal error") as err:
        ModelServer(spec).start()
    assert "cause: [" in str(err.value) and line in str(err.value)


@pytest.mark.integration
def test_old_servers_without_health_generate_use_health(tmp_path: Path) -> None:
    spec = fake_spec(tmp_path, "--no-health-generate")
    with ModelServer(spec) as server:
        assert server.health_endpoint == "/health"


@pytest.mark.integration
def test_a_stubborn_server_is_killed_with_its_group_and_its_segments_swept(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    spec = fake_spec(tmp_path, "--ignore-sigterm", "--child", "--shm-dir", str(shm), grace_s=0.5)
    own = shm / f"sgl_shm_ipc_{os.getpid()}_0000aaaa"  # a live process's segment: must survive
    with ModelServer(spec) as server:
        own.write_bytes(b"x")
        left = sorted(p.name for p in shm.iterdir() if p != own)
        assert len(left) == 3
    report = server.teardown
    assert report is not None and report.stop is not None and report.stop.killed
    assert report.stop.exit_code == -signal.SIGKILL
    assert sorted(Path(p).name for p in report.swept) == left
    assert [p.name for p in shm.iterdir()] == [own.name]
    assert isinstance(server.launcher, ProcessLauncher)
    assert_gone(server.launcher, spec.port)


@pytest.mark.integration
def test_a_failing_canary_fails_the_launch_and_tears_down(tmp_path: Path) -> None:
    spec = fake_spec(tmp_path)

    def canary(server: ModelServer) -> None:
        raise CanaryError("no hidden states were dumped for the canary sample")

    server = ModelServer(spec, canary=canary)
    with pytest.raises(CanaryError, match="no hidden states"):
        server.start()
    assert isinstance(server.launcher, ProcessLauncher)
    assert_gone(server.launcher, spec.port)


@pytest.mark.integration
def test_a_server_dying_under_its_canary_is_a_crash_after_ready(tmp_path: Path) -> None:
    """The canary's request failed because the server died: that says nothing about its hidden states.
    The launch reports the crash, marked `after_ready` (the extraction worker restarts such a server)."""
    spec = fake_spec(tmp_path)

    def canary(server: ModelServer) -> None:
        assert isinstance(server.launcher, ProcessLauncher) and server.launcher.pid is not None
        os.kill(server.launcher.pid, signal.SIGKILL)
        while server.launcher.exit_code() is None:
            time.sleep(0.05)
        raise CanaryError("canary extraction failed: Server disconnected without sending a response")

    server = ModelServer(spec, canary=canary)
    with pytest.raises(ServerCrashedError, match="exited while serving: killed by SIGKILL") as caught:
        server.start()
    assert caught.value.after_ready and isinstance(caught.value.__cause__, CanaryError)
    assert_gone(server.launcher, spec.port)


@pytest.mark.integration
def test_keyboard_interrupt_during_the_wait_tears_down(tmp_path: Path) -> None:
    spec = fake_spec(tmp_path, "--shards", "3", "--hang-at-shard", "2")
    server = ModelServer(spec)

    def interrupt(fraction: float, message: str) -> None:
        if message.startswith("weights: shard 2/"):
            raise KeyboardInterrupt

    server.progress = interrupt
    with pytest.raises(KeyboardInterrupt):
        server.start()
    assert isinstance(server.launcher, ProcessLauncher)
    assert_gone(server.launcher, spec.port)


@pytest.mark.integration
def test_check_alive_reports_a_crash_while_serving(tmp_path: Path) -> None:
    spec = fake_spec(tmp_path)
    with ModelServer(spec) as server:
        server.check_alive()
        assert isinstance(server.launcher, ProcessLauncher) and server.launcher.pid is not None
        os.kill(server.launcher.pid, signal.SIGKILL)
        while server.launcher.exit_code() is None:
            time.sleep(0.05)
        with pytest.raises(ServerCrashedError, match="exited while serving: killed by SIGKILL"):
            server.check_alive()
    assert_gone(server.launcher, spec.port)


@pytest.mark.integration
def test_only_vital_processes_are_watched_compiler_children_may_come_and_go(tmp_path: Path) -> None:
    """A child that exits while the server serves (torch.compile's g++ beside SGLang's scheduler) is no
    crash; the loss of the scheduler is, named by its process title."""
    vital = ("sglang::scheduler", "sglang::detokenizer")
    compiled = tmp_path / "compiled"  # the compiler child exits once this exists
    spec = fake_spec(tmp_path, "--child", "--compiler-child", str(compiled), vital_children=vital)
    with ModelServer(spec) as server:
        launcher = server.launcher
        assert isinstance(launcher, ProcessLauncher)
        children = psutil.Process(launcher.pid).children(recursive=True)
        compiler = [c for c in children if c.name() != "sglang::scheduler"]
        (scheduler,) = [c for c in children if c.name() == "sglang::scheduler"]
        assert len(compiler) == 1
        compiled.touch()
        assert compiler[0].wait(timeout=10) is None  # it came and went (reaped) while the server served
        time.sleep(3 * spec.poll_interval_s)
        server.check_alive()
        scheduler.kill()
        deadline = time.monotonic() + 10
        while server.crash_detected_at is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(ServerCrashedError, match=rf"lost pid {scheduler.pid} \(sglang::scheduler\)"):
            server.check_alive()
    assert_gone(launcher, spec.port)


DRIVER = """
import sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from aerie.serving import ModelServer
from tests.fake_servers.scenarios import fake_spec
server = ModelServer(fake_spec(Path({work!r}), "--ignore-sigterm", "--child", grace_s=0.5))
with server:
    print(server.launcher.pgid, flush=True)
    time.sleep(600)
"""


@pytest.mark.integration
def test_sigterm_to_the_orchestrator_tears_the_server_down(tmp_path: Path) -> None:
    """A cancelled flow run gets SIGTERM; the server, in its own session, must not outlive it."""
    root = str(Path(__file__).resolve().parents[1])
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER.format(root=root, work=str(tmp_path))],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert driver.stdout is not None
    pgid = int(driver.stdout.readline())
    assert live_group_members(pgid)  # the server (and its child) are up
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=60) == 128 + signal.SIGTERM
    assert live_group_members(pgid) == []


PORT_DRIVER = """
import sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from aerie.serving import ModelServer, ProcessLauncher
from tests.fake_servers.scenarios import fake_spec
# A server that outlives its owner, as one started before servers died with their owner would.
launcher = ProcessLauncher(die_with_owner=False)
server = ModelServer(fake_spec(Path({work!r}), "--child", port={port}), launcher=launcher)
with server:
    print(server.launcher.pgid, flush=True)
    time.sleep(600)
"""


@pytest.mark.integration
def test_a_server_left_by_a_killed_run_is_ended_by_the_next_launch(tmp_path: Path) -> None:
    """kill -9 of the orchestrator skips every teardown: a server that does not die with it (in its own
    session, its parent-death signal off) keeps the port. The next launch on that port finds it marked as
    launched by a process that is gone, ends it, and starts; a stale server nobody marked is still refused
    (test_a_stale_server_on_the_port...)."""
    root = str(Path(__file__).resolve().parents[1])
    port = free_port()
    (tmp_path / "first").mkdir()
    driver = subprocess.Popen(
        [sys.executable, "-c", PORT_DRIVER.format(root=root, work=str(tmp_path / "first"), port=port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert driver.stdout is not None
    pgid = int(driver.stdout.readline())
    driver.kill()
    assert driver.wait(timeout=60) == -signal.SIGKILL
    assert live_group_members(pgid) and not port_is_free("127.0.0.1", port)  # the orphan holds the port
    with ModelServer(fake_spec(tmp_path, port=port)) as server:
        assert server.info["weight_version"] == server.spec.weight_version
        assert live_group_members(pgid) == []
    assert isinstance(server.launcher, ProcessLauncher)
    assert_gone(server.launcher, port)
