"""The reference server's lifecycle as a real process: SGLang-format startup lines, the port bound only
after loading, /health_generate 503 until the warm-up succeeds, identity endpoints, and a graceful
SIGTERM (503 at once, in-flight requests finish, exit 0, port released). Also argument checks that
fail before any loading."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from aerie.engine.server.args import ArgsError, RefServerArgs, parse_args
from aerie.engine.server.sglang_log import READY_LINE
from tests.refserver_support import ROOT, RefServer, launch, port_free, port_open

NONCE = "run-lifecycle-0123"


@pytest.fixture(scope="module")
def started(smollm2, tmp_path_factory: pytest.TempPathFactory):
    """Launch in serve mode with a warm-up delay and watch the port from the first instant.

    Yields the server and what the watcher saw: for each successful connect, whether the weights
    were already loaded (per the log read *after* the connect), and the /health_generate codes.
    """
    srv = launch(
        smollm2.path,
        tmp_path_factory.mktemp("lifecycle"),
        "--weight-version",
        NONCE,
        "--served-model-name",
        "smol-test",
        "--device",
        "cpu",
        "--warmup-delay-s",
        "2",
    )
    refused = 0
    loaded_at_first_connect = None
    codes: list[int] = []
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline and srv.proc.poll() is None:
            if loaded_at_first_connect is None:
                if port_open(srv.port):
                    # Connect succeeded, so the bind happened; the load line must already be in the log.
                    loaded_at_first_connect = "Load weight end." in srv.log()
                else:
                    refused += 1
                    time.sleep(0.02)
                    continue
            code = httpx.get(srv.url + "/health_generate", timeout=30).status_code
            if not codes or codes[-1] != code:
                codes.append(code)
            if code == 200:
                break
            time.sleep(0.05)
        assert srv.proc.poll() is None, srv.log()[-3000:]
        yield srv, {"refused": refused, "loaded_at_first_connect": loaded_at_first_connect, "codes": codes}
    finally:
        srv.stop()


@pytest.mark.integration
def test_port_is_bound_only_after_the_weights_are_loaded(started) -> None:
    _, seen = started
    assert seen["refused"] > 0
    assert seen["loaded_at_first_connect"] is True


@pytest.mark.integration
def test_health_generate_is_503_until_the_warm_up_succeeds(started) -> None:
    srv, seen = started
    assert seen["codes"] == [503, 200]
    assert httpx.get(srv.url + "/health").status_code == 200
    assert httpx.get(srv.url + "/ready").status_code == 200


@pytest.mark.integration
def test_startup_log_lines_are_in_sglang_format_and_order(started) -> None:
    srv, _ = started
    log = srv.log()
    stamp = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] "
    patterns = [
        stamp + r"Load weight begin\. avail mem=\d+\.\d\d GB",
        r"Loading safetensors checkpoint shards: 100% Completed \| 1/1 \[\d\d:\d\d<\d\d:\d\d, ",
        stamp
        + r"Load weight end\. elapsed=\d+\.\d\d s, type=LlamaForCausalLM, dtype=torch\.float32, avail mem=",
        stamp + r"KV Cache is allocated\. dtype: torch\.float32, #tokens: \d+, K size: ",
        stamp + r"INFO:     Uvicorn running on http://127\.0\.0\.1:\d+ \(Press CTRL\+C to quit\)",
        stamp + r"The server is fired up and ready to roll!",
    ]
    positions = []
    for pattern in patterns:
        match = re.search(pattern, log)
        assert match, f"{pattern!r} not in the log:\n{log[-3000:]}"
        positions.append(match.start())
    assert positions == sorted(positions)


@pytest.mark.integration
def test_identity_endpoints_echo_the_launch(started, smollm2) -> None:
    srv, _ = started
    info = httpx.get(srv.url + "/server_info").json()
    assert info["weight_version"] == NONCE and info["status"] == "Up"
    assert info["mode"] == "serve" and info["pid"] == srv.proc.pid
    assert info["model_path"] == smollm2.path and info["aux_layers"] == [2, 15, 27]
    assert info["max_batch_tokens"] > 0 and info["version"]
    assert httpx.get(srv.url + "/model_info").json()["weight_version"] == NONCE
    assert httpx.get(srv.url + "/v1/models").json()["data"][0]["id"] == "smol-test"


@pytest.mark.integration
def test_serve_mode_refuses_hidden_states_and_answers_prefill_only(started, tmp_path: Path) -> None:
    srv, _ = started
    reply = httpx.post(
        srv.url + "/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0}, "return_hidden_states": True},
    )
    assert reply.status_code == 400 and "not configured to return hidden states" in reply.json()["message"]
    reply = httpx.post(
        srv.url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0}}
    )
    assert reply.status_code == 200
    assert reply.json()["output_ids"] == [] and "dump" not in reply.json()["meta_info"]


def _long_chat(srv: RefServer, out: dict) -> None:
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 120,
        "temperature": 0,
        "ignore_eos": True,
    }
    out["reply"] = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)


@pytest.mark.integration
def test_sigterm_drains_in_flight_requests_then_exits_0(started) -> None:
    """Runs last in this module: it ends the module's server."""
    srv, _ = started
    result: dict = {}
    worker = threading.Thread(target=_long_chat, args=(srv, result))
    worker.start()
    deadline = time.monotonic() + 60
    while httpx.get(srv.url + "/server_info").json()["internal_states"][0]["num_running_reqs"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    srv.proc.send_signal(signal.SIGTERM)
    # Health turns 503 at once while the port stays open for the draining request; new work is refused.
    deadline = time.monotonic() + 10
    while httpx.get(srv.url + "/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    refused = httpx.post(
        srv.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    )
    assert refused.status_code == 503
    worker.join(300)
    assert result["reply"].status_code == 200
    assert result["reply"].json()["usage"]["completion_tokens"] == 120
    assert srv.proc.wait(60) == 0
    assert port_free(srv.port)
    assert "SIGTERM received" in srv.log()


# -- argument checks: no model is loaded ----------------------------------------------------------


def test_args_round_trip_and_checks(smollm2, tmp_path: Path) -> None:
    args = parse_args(["--model-path", smollm2.path, "--mode", "extract", "--dump-dir", str(tmp_path / "d")])
    assert (tmp_path / "d").is_dir()
    assert parse_args(args.to_argv()).resolved_dict() == args.resolved_dict()
    assert isinstance(args, RefServerArgs) and args.aux_layers is None
    with pytest.raises(ArgsError, match="--dump-dir"):
        parse_args(["--model-path", smollm2.path, "--mode", "extract"])
    with pytest.raises(ArgsError, match="config.json"):
        parse_args(["--model-path", str(tmp_path)])
    with pytest.raises(ArgsError, match="unique"):
        parse_args(["--model-path", smollm2.path, "--aux-layers", "2", "2", "5"])
    writers = parse_args(["--model-path", smollm2.path, "--dump-writers", "4"])
    assert writers.dump_writers == 4 and parse_args(writers.to_argv()).dump_writers == 4
    with pytest.raises(ArgsError, match="--dump-writers must be positive"):
        parse_args(["--model-path", smollm2.path, "--dump-writers", "0"])
    assert args.dump_dtype == "model" and args.resolved_dict()["dump_dtype"] == "model"
    fp8 = parse_args([*args.to_argv(), "--dump-dtype", "fp8"])
    assert fp8.dump_dtype == "fp8" and parse_args(fp8.to_argv()).dump_dtype == "fp8"
    with pytest.raises(ArgsError, match="--dump-dtype fp8: only --mode extract"):
        parse_args(["--model-path", smollm2.path, "--dump-dtype", "fp8"])
    traced = parse_args([*args.to_argv(), "--trace-packs", "8:4", "--trace-dir", str(tmp_path / "t")])
    assert parse_args(traced.to_argv()).resolved_dict() == traced.resolved_dict()
    with pytest.raises(ArgsError, match="needs --trace-dir"):
        parse_args([*args.to_argv(), "--trace-packs", "8:4"])
    with pytest.raises(ArgsError, match="SKIP:COUNT"):
        parse_args([*args.to_argv(), "--trace-packs", "8", "--trace-dir", str(tmp_path / "t")])
    with pytest.raises(ArgsError, match="only --mode extract runs packs"):
        parse_args(["--model-path", smollm2.path, "--trace-packs", "1:1", "--trace-dir", str(tmp_path)])


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "aerie.engine", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.mark.integration
def test_a_draft_directory_without_a_drafter_fails_the_start_naming_it(smollm2, tmp_path: Path) -> None:
    done = _run_cli(
        "--model-path", smollm2.path, "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", str(tmp_path), "--speculative-num-steps", "3",
    )  # fmt: skip
    assert done.returncode == 1
    assert "Initialization failed" in done.stderr and str(tmp_path / "config.json") in done.stderr
    assert READY_LINE not in done.stderr


@pytest.mark.integration
def test_out_of_range_aux_layers_fail_before_loading(smollm2) -> None:
    done = _run_cli("--model-path", smollm2.path, "--aux-layers", "2", "15", "30")
    assert done.returncode == 2
    assert "out of range for a 30-layer model" in done.stderr
    assert "Load weight begin" not in done.stderr
