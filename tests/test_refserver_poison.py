"""A reference server that cannot be poisoned: an allocation failure in a step leaves nothing pointing at
freed memory and the server answers on, correctly; steps that keep failing turn it unhealthy, and the
serving watch ends it so that its owner starts a fresh one.

Faults are injected through `AERIE_REFSERVER_FAULTS` (aerie.engine.server.faults): `kv_alloc` makes a
KV cache allocation raise `torch.OutOfMemoryError` exactly as a full device does, `step` makes decoding
steps raise. The CUDA graph path runs here with a stand-in runner (a CUDA graph needs a GPU): its
"graphs" remember the addresses of the KV buffers they were captured on and refuse to replay once any
of them is gone, which is what turned into "an illegal memory access" on an H100.
`benchmarks/gpu/gpu_oom_fault.py` forces the same failure with real CUDA graphs on a GPU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from aerie.engine.generation import GenRequest, SamplingParams
from aerie.engine.server import faults, packed
from aerie.engine.server.decode_graphs import DecodeGraphs
from aerie.engine.server.memory import plan_kv
from aerie.engine.server.scheduler import Scheduler
from aerie.engine.server.slots import SlotDecoder
from aerie.errors import ServerCrashedError
from tests.refserver_support import launch, wait_ready

PROMPTS = ["The capital of France is", "List three colors:", "def fibonacci(n):", "2 + 2 ="]


# -- the sizing -----------------------------------------------------------------------------------


def test_the_plan_lowers_a_batch_the_memory_cannot_hold_and_a_given_size_wins() -> None:
    # SmolLM2-135M in bfloat16: 30 layers x 3 KV heads x 64 dims x 2 bytes x (K, V) per cell.
    cell = 2 * 30 * 3 * 64 * 2
    on_h100 = plan_kv(
        cell=cell,
        context=8192,
        quantum=256,
        asked_running=512,
        max_total_tokens=None,
        budget=(63 * 2**30, "x"),
    )
    assert on_h100.capacity == 63 * 2**30 // cell
    assert on_h100.max_running == on_h100.capacity // 8192 < 512
    assert on_h100.max_running * 8192 * cell <= 63 * 2**30
    assert "lowered from 512" in on_h100.line()
    eager = plan_kv(
        cell=cell,
        context=8192,
        quantum=256,
        asked_running=512,
        max_total_tokens=None,
        budget=(63 * 2**30, "x"),
        fixed_rows=False,
    )
    assert eager.max_running == 512 and "waits until the cache has room" in eager.line()
    roomy = plan_kv(
        cell=cell,
        context=8192,
        quantum=256,
        asked_running=64,
        max_total_tokens=None,
        budget=(63 * 2**30, "x"),
    )
    assert roomy.max_running == 64 and "fits at the full context" in roomy.line()
    given = plan_kv(
        cell=cell, context=8000, quantum=256, asked_running=64, max_total_tokens=8192 * 4, budget=(1, "x")
    )
    assert (given.capacity, given.positions, given.max_running) == (8192 * 4, 8192, 4)
    assert given.source == "--max-total-tokens"


# -- the graph path, in process -------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(smollm2: Any) -> Any:
    from aerie.engine.server.loader import load_model

    packed.register()
    return load_model(smollm2.path, "cpu", "float32", skip_tokenizer=False)


class _AddressGraph:
    def __init__(self, body: Callable[[], Any], buffers: Callable[[], list[torch.Tensor]]) -> None:
        self.body, self.buffers = body, buffers
        self.addresses = [t.data_ptr() for t in buffers()]

    def replay(self) -> None:
        now = [t.data_ptr() for t in self.buffers()]
        if now != self.addresses:
            raise RuntimeError(
                "stand-in: a graph replayed KV buffers that were freed (illegal memory access)"
            )
        self.body()


class AddressCheckingRunner:
    """Stand-in for `CudaGraphRunner` (which needs a GPU): a replay checks that every KV buffer its graph
    was captured on is still the live one, then reruns the step."""

    def __init__(self, buffers: Callable[[], list[torch.Tensor]]) -> None:
        self.buffers = buffers
        self.captured = 0

    def new_pool(self) -> object:
        return object()

    def warm_up(self, body: Callable[[], Any]) -> None:
        body()

    def capture(self, body: Callable[[], Any], pool: object) -> _AddressGraph:
        self.captured += 1
        return _AddressGraph(body, self.buffers)


def _graph_decoder(loaded: Any) -> SlotDecoder:
    dec = SlotDecoder(
        loaded.model,
        loaded.tokenizer,
        graphs="static",
        eos_token_ids=loaded.eos_token_ids,
        device="cpu",
        max_running=8,
        max_prefill_tokens=4096,
        seed=0,
    )
    head = dec.model.lm_head.weight
    runner = AddressCheckingRunner(lambda: [*dec.kv.k, *dec.kv.v])
    dec.graphs = DecodeGraphs(
        dec._decode_logits, dec.kv, 8, vocab=head.shape[0], dtype=head.dtype, runner=runner, quantum=256
    )
    return dec


def _generate(dec: SlotDecoder, waves: list[list[GenRequest]]) -> tuple[dict[str, list[int]], Scheduler]:
    """Each wave submitted to a real Scheduler once the one before has started decoding."""
    scheduler = Scheduler(dec, None, None, max_batch_tokens=4096)
    scheduler.start()
    try:
        futures = []
        for wave in waves:
            futures += scheduler.submit_generations(wave)
            time.sleep(0.5)
        return {f.result(900).request.rid: f.result().output_ids for f in futures}, scheduler
    finally:
        scheduler.stop()


def _waves(loaded: Any) -> list[list[GenRequest]]:
    """Short requests, then a ~300-token one that grows the cache from 256 to 512 positions while the
    first run (the growth that hit the allocation failure on the H100)."""
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    first = [GenRequest(f"r{i}", loaded.tokenizer(p)["input_ids"], params) for i, p in enumerate(PROMPTS)]
    long_prompt = loaded.tokenizer("the quick brown fox jumps over the lazy dog " * 34)["input_ids"]
    return [first, [GenRequest("long", long_prompt, SamplingParams(max_new_tokens=5, temperature=0.0))]]


def test_an_allocation_failure_mid_growth_leaves_no_graph_on_freed_buffers(
    loaded: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    waves = _waves(loaded)
    unfaulted, _ = _generate(_graph_decoder(loaded), waves)
    # The first wave's prefill allocates 4 rows (60 buffers: 30 layers, K and V), its first graph step
    # all 8 rows (60 more). The growth to 512 positions fails after replacing 7 buffers, as a device that
    # runs out part-way does.
    monkeypatch.setattr(faults, "_points", faults.parse("kv_alloc=127:1"))
    dec = _graph_decoder(loaded)
    faulted, scheduler = _generate(dec, waves)
    assert scheduler.stats.oom_recoveries == 1 and scheduler.stats.failures == 1
    assert faulted == unfaulted  # the batch waited and ran again from its prompts: the same greedy tokens
    assert dec.graphs is not None and not dec.graphs.disabled  # captured again, not switched off
    assert dec.kv.length == 512 and scheduler.unhealthy == ""


def test_a_request_the_cache_can_never_hold_is_refused_with_the_sizes(loaded: Any) -> None:
    dec = _graph_decoder(loaded)
    dec.capacity = dec.kv.capacity = 8 * 512  # 8 graph rows of 512 positions
    params = SamplingParams(max_new_tokens=600, temperature=0.0)
    scheduler = Scheduler(dec, None, None, max_batch_tokens=4096)
    scheduler.start()
    try:
        ok, too_long = scheduler.submit_generations(
            [
                GenRequest("ok", loaded.tokenizer(PROMPTS[0])["input_ids"], SamplingParams(max_new_tokens=8)),
                GenRequest("long", loaded.tokenizer(PROMPTS[1])["input_ids"], params),
            ]
        )
        assert len(ok.result(120).output_ids) == 8
        with pytest.raises(ValueError, match=r"rid long: the request may reach 768 positions .* 4,096 cells"):
            too_long.result(120)
    finally:
        scheduler.stop()


# -- the real server process ----------------------------------------------------------------------


def _post(url: str, prompt: str | list[str], tokens: int = 16) -> httpx.Response:
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": tokens}}
    return httpx.post(f"{url}/generate", json=body, timeout=120)


@pytest.mark.integration
@pytest.mark.slow
def test_the_server_survives_an_out_of_memory_step_and_answers_correctly(
    smollm2: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The warm-up allocates one row's 60 buffers; the 4-prompt batch's growth then fails at its first.
    monkeypatch.setenv(faults.FAULTS_ENV, "kv_alloc=60:1")
    server = launch(smollm2.path, tmp_path, "--device", "cpu", "--dtype", "float32", "--random-seed", "0")
    try:
        wait_ready(server, timeout=600)  # a loaded shared host can take minutes to start it
        alone = _post(server.url, PROMPTS[0])
        assert alone.status_code == 200, alone.text
        batch = _post(server.url, PROMPTS)
        assert batch.status_code == 200, batch.text  # the failed step's requests waited and ran again
        assert batch.json()[0]["output_ids"] == alone.json()["output_ids"]
        assert httpx.get(f"{server.url}/health_generate", timeout=30).status_code == 200
        info = httpx.get(f"{server.url}/server_info", timeout=10).json()
        assert info["internal_states"][0]["oom_recoveries"] == 1
        assert info["unhealthy"] is None
        later = _post(server.url, PROMPTS[0])
        assert later.status_code == 200 and later.json()["output_ids"] == alone.json()["output_ids"]
        log = server.log()
        assert "injected by AERIE_REFSERVER_FAULTS (kv_alloc)" in log
        assert "the KV cache and CUDA graphs were dropped" in log
        assert "KV cache plan:" in log
    finally:
        server.stop()


def _turn_unhealthy(url: str) -> httpx.Response:
    """Requests until /health answers 503 (each fails at a decoding step); that answer."""
    for _ in range(8):
        assert _post(url, PROMPTS[0], tokens=32).status_code in (500, 503)
        health = httpx.get(f"{url}/health", timeout=30)
        if health.status_code == 503 and "unhealthy" in health.text:
            return health
    raise AssertionError("the server never reported itself unhealthy")


@pytest.mark.integration
@pytest.mark.slow
def test_steps_that_keep_failing_turn_the_server_unhealthy_with_the_reason(
    smollm2: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The warm-up (a prefill, up to 7 decoding steps) and the first health probe pass, then no step does.
    monkeypatch.setenv(faults.FAULTS_ENV, "step=9:*")
    server = launch(smollm2.path, tmp_path, "--device", "cpu", "--unhealthy-after", "3")
    try:
        wait_ready(server, timeout=600)  # a loaded shared host can take minutes to start it
        health = _turn_unhealthy(server.url)
        assert health.status_code == 503
        assert "3 generation steps failed in a row" in health.json()["message"]
        assert httpx.get(f"{server.url}/health_generate", timeout=30).status_code == 503
        refused = _post(server.url, PROMPTS[1])
        assert refused.status_code == 503 and "unhealthy" in refused.json()["message"]
        assert "The reference server is unhealthy" in server.log()
    finally:
        server.stop()


@pytest.mark.integration
@pytest.mark.slow
def test_the_watch_ends_an_unhealthy_server_and_a_fresh_one_serves(smollm2: Any, tmp_path: Path) -> None:
    from aerie.serving import ModelServer, ServerConfig, spec_for
    from tests.fake_servers.scenarios import free_port

    def config(env: dict[str, str]) -> Any:
        return ServerConfig(
            port=port, device="cpu", grace_s=15.0, shm_dir=str(tmp_path / "shm"), env=env, poll_interval_s=0.2
        )

    port = free_port()
    faulty = spec_for(
        config({faults.FAULTS_ENV: "step=9:*"}), model_path=smollm2.path, log_path=tmp_path / "a.log"
    )
    with ModelServer(faulty) as server:
        for _ in range(8):  # each request fails at a step; the third failure in a row ends the server
            try:
                _post(server.url, PROMPTS[0], tokens=32)
            except httpx.TransportError:  # the watch ended it while this request was on its way
                break
            if server.crash_detected_at is not None:
                break
        deadline = time.monotonic() + 10
        while server.crash_detected_at is None and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(ServerCrashedError, match="unhealthy") as crash:
            server.check_alive()
        assert crash.value.after_ready  # what the extraction worker restarts a server for
        deadline = time.monotonic() + 10
        while server.launcher.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.launcher.exit_code() is not None  # ended, not left answering 503
    # What an owner does with a crashed server: a fresh launch on the same port serves again.
    healthy = spec_for(config({}), model_path=smollm2.path, log_path=tmp_path / "b.log")
    with ModelServer(healthy) as server:
        assert _post(server.url, PROMPTS[0]).status_code == 200
    assert os.environ.get(faults.FAULTS_ENV) is None
