"""An online training stopped and resumed, with real reference servers: after a SIGTERM or a SIGKILL of
the trainer's process it resumes at the step it checkpointed and takes the same next rows (every step
once, each with the uninterrupted run's loss), starting its servers again; a server killed mid-run is
restarted and the request it was answering is sent again (no row lost, none taken twice)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from aerie.serving.probe import port_holders, port_is_free
from aerie.store import LocalStore
from tests.conftest import free_port
from tests.online_support import (
    corpus_with_counts,
    extract_config,
    losses,
    online,
    resume_train_config,
    server_config,
)
from tests.processes import stop
from tests.train_support import tiny_target

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # reference server processes, child trainers

REPO = Path(__file__).resolve().parents[1]
# The trainer as its own process. Its progress holds the loop at step 3 (after the step, before its
# checkpoint) until the test has sent its signal: the signal lands inside a step, whatever this host's speed.
CHILD = """
import json, sys, time
from pathlib import Path
import torch
from aerie.manifest import StageResult
from aerie.store import LocalStore
from aerie.targets import TargetInfo
from tests.online_support import extract_config, online, resume_train_config, server_config
args = json.loads(sys.argv[1])
torch.set_num_threads(1)
tmp = Path(args["tmp"])
held, go = tmp / "held", tmp / "go"

def progress(fraction, message):
    if message.startswith("step 3/"):
        held.touch()
        while not go.exists():
            time.sleep(0.05)

online(
    LocalStore(args["store"]),
    TargetInfo.model_validate(args["target"]),
    StageResult.model_validate(args["corpus"]),
    resume_train_config(tmp),
    extract_config(tmp),
    server=server_config(args["port"]),
    progress=progress,
)
"""
WAIT_S = 300  # a hang guard for the child's start and its step 3, not a speed check


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny target and the uninterrupted online run's per-step losses, to compare each resumed one with.
    Its corpus (about 300 tokens) is far under the default look-ahead budget: the run ends all the same."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("straight")
    target, _ = tiny_target(root)
    store = LocalStore(root / "store")
    corpus = corpus_with_counts(store, root, target, train=10, held=3)
    result = online(store, target, corpus, resume_train_config(root), extract_config(root))
    straight = losses(store, result)
    assert len(straight) > 4
    return target, straight


def _store_and_corpus(tmp: Path, target):
    store = LocalStore(tmp / "store")
    return store, corpus_with_counts(store, tmp, target, train=10, held=3)


def _latest(store: LocalStore, prefix: str) -> int:
    return int(json.loads(store.get_bytes(f"{prefix}/checkpoints/latest.json"))["step"])


def _runs(store: LocalStore, prefix: str) -> list[int]:
    lines = store.get_bytes(f"{prefix}/metrics.jsonl").decode().splitlines()
    return [r["runs"] for r in map(json.loads, lines) if r["kind"] == "train"]


def _wait_for(path: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        assert proc.poll() is None, f"the trainer exited with {proc.returncode} before step 3"
        assert time.monotonic() < deadline, "the trainer did not reach step 3"
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stopped_online_run_resumes_at_its_step_with_the_same_next_rows(setup, tmp_path, sig):
    target, straight = setup
    store, corpus = _store_and_corpus(tmp_path, target)
    port = free_port()
    args = {
        "tmp": str(tmp_path), "store": str(tmp_path / "store"), "port": port,
        "target": target.model_dump(mode="json"), "corpus": corpus.model_dump(mode="json"),
    }  # fmt: skip
    log = open(tmp_path / "child.log", "wb")  # noqa: SIM115 - closed below
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_for(tmp_path / "held", child)
        server_pids = port_holders(port)
        assert server_pids, "the trainer's server is not listening"
        os.kill(child.pid, sig)  # the trainer alone: its server runs in a session of its own
        (tmp_path / "go").touch()
        code = child.wait(timeout=WAIT_S)
    finally:
        stop(child)
        log.close()
    assert code == -sig, (tmp_path / "child.log").read_text()[-3000:]
    prefix = next(k for k in store.list("online/train") if k.endswith("/checkpoints/latest.json"))
    prefix = prefix.removesuffix("/checkpoints/latest.json")
    stopped_at = _latest(store, prefix)
    if sig == signal.SIGTERM:
        assert stopped_at == 3  # the step the signal came in, checkpointed although they fall every step
        assert port_is_free("127.0.0.1", port)  # its servers were stopped before the process ended
    else:
        assert stopped_at == 2  # killed before step 3's checkpoint
        # Its server dies with it (SIGKILL is the server's parent-death signal): none is left behind.
        deadline = time.monotonic() + 10
        while port_holders(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not port_holders(port), f"the SIGKILLed trainer's server {server_pids} outlived it"

    result = online(store, target, corpus, resume_train_config(tmp_path), extract_config(tmp_path),
                    server=server_config(port))  # fmt: skip
    assert losses(store, result) == straight  # every step once, each on the same rows as straight
    assert _runs(store, prefix) == [1] * stopped_at + [2] * (len(straight) - stopped_at)
    manifest = json.loads(store.get_bytes(f"{result.prefix}/manifest.json"))
    (rank,) = manifest["online"]["ranks"]
    (server,) = rank["servers"]
    assert server["starts"] == 1 and server["restarts"] == 0 and server["state"] == "stopped"
    assert port_is_free("127.0.0.1", port)


def test_a_server_killed_mid_run_is_restarted_and_its_request_sent_again(setup, tmp_path):
    target, straight = setup
    store, corpus = _store_and_corpus(tmp_path, target)
    port = free_port()
    killed: list[int] = []

    def kill_the_server_at_step_2(fraction: float, message: str) -> None:
        if message.startswith("step 2/") and not killed:
            for pid in port_holders(port):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
                killed.append(pid)

    # A look-ahead of about one request and one row prefetched: rows after step 2 are requested after the kill.
    cfg = resume_train_config(tmp_path)
    small = cfg.online.model_copy(update={"buffer_tokens": 100})
    cfg = cfg.model_copy(update={"online": small, "prefetch_batches": 1})
    result = online(
        store, target, corpus, cfg, extract_config(tmp_path), server=server_config(port),
        progress=kill_the_server_at_step_2,
    )  # fmt: skip
    assert killed
    assert losses(store, result) == straight  # no row lost, none taken twice
    manifest = json.loads(store.get_bytes(f"{result.prefix}/manifest.json"))
    (rank,) = manifest["online"]["ranks"]
    (server,) = rank["servers"]
    assert server["starts"] == 2 and server["restarts"] == 1 and server["errors"]
    # Each request answered once: the one that failed on the dead server counts when it was answered.
    assert server["requests"] == rank["requests"]
    assert manifest["figures"]["server_restarts"] == 1
