"""The slot decoder against the plain batched decoder, on the real embedded target in float32.

Rule under test: greedy decoding gives the same tokens whether a request runs alone, in a batch, or
joins a batch mid-flight while others finish and rows are moved (the slot decoder's row moves and
scattered K/V writes are where it could go wrong).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from aerie.engine.generation import BatchedDecoder, GenRequest, GenResult, SamplingParams
from aerie.engine.server import packed
from aerie.engine.server.decode_graphs import DecodeGraphs, pad_width, plan_widths
from aerie.engine.server.slots import KVSlots, SlotDecoder, supports

PROMPTS = [
    "The capital of France is",
    "List three colors:",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Translate to French: good morning",
    "2 + 2 =",
]


@pytest.fixture(scope="module")
def loaded(smollm2: Any) -> Any:
    from aerie.engine.server.loader import load_model

    packed.register()
    return load_model(smollm2.path, "cpu", "float32", skip_tokenizer=False)


def _decoder(
    cls: type[BatchedDecoder], loaded: Any, max_running: int = 8, device: str = "cpu", **extra: Any
) -> BatchedDecoder:
    return cls(
        loaded.model,
        loaded.tokenizer,
        eos_token_ids=loaded.eos_token_ids,
        device=device,
        max_running=max_running,
        max_prefill_tokens=4096,
        seed=0,
        **extra,
    )


def _requests(loaded: Any, lengths: list[int]) -> list[GenRequest]:
    tok = loaded.tokenizer
    return [
        GenRequest(f"r{i}", tok(p)["input_ids"], SamplingParams(max_new_tokens=n, temperature=0.0))
        for i, (p, n) in enumerate(zip(PROMPTS[: len(lengths)], lengths, strict=True))
    ]


def _drive(dec: BatchedDecoder, waves: list[list[GenRequest]], steps_between: int) -> dict[str, list[int]]:
    """Admit each wave after `steps_between` decoding steps; run to the end; outputs by rid."""
    done: dict[str, list[int]] = {}

    def collect(results: list[GenResult]) -> None:
        done.update({r.request.rid: r.output_ids for r in results})

    with torch.inference_mode():
        for wave in waves:
            collect(dec.admit(wave))
            for _ in range(steps_between):
                collect(dec.step())
        while dec.num_running:
            collect(dec.step())
    return done


def test_smollm2_qualifies(loaded: Any) -> None:
    assert supports(loaded.model)


def test_greedy_alone_equals_batched_decoder(loaded: Any) -> None:
    reqs = _requests(loaded, [10, 10])
    for req in reqs:
        plain = _drive(_decoder(BatchedDecoder, loaded), [[req]], 0)
        slot = _drive(_decoder(SlotDecoder, loaded), [[req]], 0)
        assert slot == plain, req.rid


def test_joining_and_finishing_rows_keep_every_output_exact(loaded: Any) -> None:
    # Different lengths finish at different steps (rows move), a second wave joins mid-flight. The
    # batched decoder's batch == alone rule is tested in test_refserver.py; here both must agree.
    reqs = _requests(loaded, [2, 11, 4, 12, 6, 9])
    waves = [reqs[:4], reqs[4:]]
    plain = _drive(_decoder(BatchedDecoder, loaded), waves, steps_between=3)
    mixed = _drive(_decoder(SlotDecoder, loaded), waves, steps_between=3)
    assert mixed == plain
    assert {rid: len(ids) for rid, ids in mixed.items()} == {r.rid: r.params.max_new_tokens for r in reqs}


def test_the_graph_shaped_step_decodes_exactly_like_the_eager_one(loaded: Any) -> None:
    # What a CUDA graph replays (all rows, free ones on dummy tokens; width rounded up to a bucket,
    # ids and positions from static buffers), run eagerly: a GPU is needed only for the capture itself.
    reqs = _requests(loaded, [2, 11, 4, 12, 6, 9])
    waves = [reqs[:4], reqs[4:]]
    eager = _drive(_decoder(SlotDecoder, loaded), waves, steps_between=3)
    static = _decoder(SlotDecoder, loaded, graphs="static")
    assert _drive(static, waves, steps_between=3) == eager
    assert isinstance(static, SlotDecoder) and static.graphs is not None
    assert static.kv.rows == 8 and static.kv.length % 256 == 0  # every row, bucketed width


def test_max_running_limits_admission(loaded: Any) -> None:
    dec = _decoder(SlotDecoder, loaded, max_running=2)
    reqs = _requests(loaded, [5] * len(PROMPTS))
    assert dec.can_admit(reqs[0], 0, 0)
    assert dec.can_admit(reqs[1], 1, len(reqs[0].input_ids))
    assert not dec.can_admit(reqs[2], 2, 20)


def test_a_running_batch_admits_only_once_an_eighth_of_its_rows_is_free(loaded: Any) -> None:
    dec = _decoder(SlotDecoder, loaded, max_running=16)  # admits again at 2 free rows
    tok = loaded.tokenizer
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    reqs = [GenRequest(f"q{i}", tok(f"Count to {i}:")["input_ids"], params) for i in range(16)]
    with torch.inference_mode():
        dec.admit(reqs[:15])
    assert not dec.can_admit(reqs[15], 0, 0)  # one free row: wait for more
    empty = _decoder(SlotDecoder, loaded, max_running=16)
    assert empty.can_admit(reqs[15], 0, 0)  # an idle decoder takes anything


def test_abort_all_returns_the_running_requests_and_empties_the_batch(loaded: Any) -> None:
    dec = _decoder(SlotDecoder, loaded)
    reqs = _requests(loaded, [30, 30])
    with torch.inference_mode():
        dec.admit(reqs)
        dec.step()
    assert [r.rid for r in dec.abort_all()] == ["r0", "r1"]
    assert dec.num_running == 0 and dec.step() == []


def test_kv_slots_grow_keeping_contents() -> None:
    kv = KVSlots(num_layers=2, kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu")
    kv.ensure(2, 3)
    kv.k[1][1, 0, 2] = torch.tensor([7.0, 8.0])
    kv.ensure(3, 300)
    assert kv.k[1].shape == (3, 1, 512, 2)  # at least doubled, in multiples of 256
    assert kv.k[1][1, 0, 2].tolist() == [7.0, 8.0]
    kv.move(torch.tensor([1]), torch.tensor([0]), 3)
    assert kv.k[1][0, 0, 2].tolist() == [7.0, 8.0]


def test_kv_slots_stop_doubling_at_the_context() -> None:
    # rows x length is the memory: doubling past the model's context asks for what no request uses
    kv = KVSlots(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", max_length=600)
    kv.ensure(2, 300)
    assert kv.length == 512
    kv.ensure(2, 513)
    assert kv.length == 768  # the length asked for, in multiples of 256, not 1,024
    kv.ensure(2, 1000)
    assert kv.length == 1024  # a longer request still gets its length


# -- CUDA graphs: the bookkeeping on CPU, the capture itself only where there is a GPU --------------


class _CpuGraph:
    def __init__(self, body: Callable[[], Any], corrupt: bool) -> None:
        self.body, self.corrupt = body, corrupt

    def replay(self) -> None:
        out = self.body()
        if self.corrupt:
            out.neg_()


class CpuGraphRunner:
    """Stand-in for `CudaGraphRunner`, which needs a GPU. A "graph" keeps its body and a replay reruns
    it, as a CUDA replay reruns the captured kernels on the static buffers' current contents. Pools
    follow the CUDA caching allocator's rule that broke the first version: a pool can be captured
    into again only while a graph captured into it is alive (`create_or_incref_pool` asserts
    use_count > 0), and each capture must follow a warm-up of the same body on the capture stream."""

    def __init__(self, *, fail_capture: bool = False, corrupt_replay: bool = False) -> None:
        self.fail_capture, self.corrupt_replay = fail_capture, corrupt_replay
        self.made = 0
        self.alive: dict[object, int] = {}  # pool -> graphs captured into it and not yet destroyed
        self.captures: list[object] = []  # the pool of every capture, in order
        self.warmed: set[object] = set()

    def new_pool(self) -> object:
        self.made += 1
        return ("pool", self.made)

    def warm_up(self, body: Callable[[], Any]) -> None:
        self.warmed.add(body)
        body()

    def capture(self, body: Callable[[], Any], pool: object) -> _CpuGraph:
        assert body in self.warmed, "captured before a warm-up of the same step"
        if self.alive.get(pool, 1) == 0:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED (stand-in)")
        if self.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing (stand-in)")
        self.alive[pool] = self.alive.get(pool, 0) + 1
        self.captures.append(pool)
        graph = _CpuGraph(body, self.corrupt_replay)
        weakref.finalize(graph, self._release, pool)
        return graph

    def _release(self, pool: object) -> None:
        self.alive[pool] -= 1


def _with_runner(dec: BatchedDecoder, runner: CpuGraphRunner) -> SlotDecoder:
    """A static-shape SlotDecoder whose graphs are "captured" by `runner`."""
    assert isinstance(dec, SlotDecoder) and dec.graphs is not None
    head = dec.model.lm_head.weight
    dec.graphs = DecodeGraphs(
        dec._decode_logits,
        dec.kv,
        dec.max_running,
        vocab=head.shape[0],
        dtype=head.dtype,
        runner=runner,
        quantum=256,
    )
    return dec


def _growing_waves(loaded: Any) -> list[list[GenRequest]]:
    """Four short requests, then one whose ~300-token prompt makes the cache grow from 256 to 512
    positions while the first four run: the growth that started a second capture round and hit the
    allocator assert on the H200."""
    reqs = _requests(loaded, [6, 9, 4, 8])
    long_prompt = loaded.tokenizer("the quick brown fox jumps over the lazy dog " * 34)["input_ids"]
    assert 257 < len(long_prompt) < 500
    late = GenRequest("long", long_prompt, SamplingParams(max_new_tokens=5, temperature=0.0))
    return [reqs, [late]]


def test_planned_widths_hold_every_width_largest_first() -> None:
    assert plan_widths(256, 256) == [256]
    assert plan_widths(1024, 256) == [1024, 768, 512, 256]
    many = plan_widths(16384, 256, max_graphs=16)
    assert len(many) == 16 and many[0] == 16384 and many == sorted(many, reverse=True)
    assert all(w % 256 == 0 for w in many)
    for widths in ([1024, 768, 512, 256], many):
        for need in range(1, widths[0] + 1, 7):
            padded = pad_width(widths, need)
            assert padded >= need and not [w for w in widths if need <= w < padded]


def test_the_stand_in_refuses_a_pool_whose_graphs_are_gone() -> None:
    # What the first DecodeGraphs did on a cache growth: drop the graphs, keep `graph.pool()`, capture
    # into it again.
    runner = CpuGraphRunner()
    pool = runner.new_pool()
    runner.warm_up(body := lambda: torch.zeros(1))
    graph = runner.capture(body, pool)
    runner.capture(body, pool)  # shared while a graph of it lives: fine (that one is dropped at once)
    del graph
    with pytest.raises(RuntimeError, match="use_count > 0"):
        runner.capture(body, pool)


def test_graphs_are_captured_largest_first_into_one_fresh_pool_per_cache_generation(loaded: Any) -> None:
    waves = _growing_waves(loaded)
    eager = _drive(_decoder(SlotDecoder, loaded), waves, steps_between=2)
    runner = CpuGraphRunner()
    dec = _with_runner(_decoder(SlotDecoder, loaded, graphs="static"), runner)
    assert _drive(dec, waves, steps_between=2) == eager
    graphs = dec.graphs
    assert graphs is not None and graphs.disabled == ""
    # Round one: cache 256 wide, one width. Round two: cache grown to 512, both widths, largest
    # first, in a new pool (round one's graphs were dropped with the old buffers).
    assert dec.kv.length == 512 and list(graphs.graphs) == [512, 256]
    assert runner.captures == [("pool", 1), ("pool", 2), ("pool", 2)]
    assert graphs.captured == 3 and runner.alive == {("pool", 1): 0, ("pool", 2): 2}
    assert graphs.checked == {256, 512}  # both replayed: the long request, then the short ones outlive it


@pytest.mark.parametrize(
    ("runner", "reason"),
    [
        (CpuGraphRunner(fail_capture=True), "CUDA graph capture failed: RuntimeError"),
        (CpuGraphRunner(corrupt_replay=True), "graph replay disagrees with the eager forward"),
    ],
    ids=["capture-fails", "replay-wrong"],
)
def test_a_failed_capture_or_a_wrong_replay_leaves_decoding_eager_and_exact(
    loaded: Any, runner: CpuGraphRunner, reason: str
) -> None:
    reqs = _requests(loaded, [5, 7, 3])
    eager = _drive(_decoder(SlotDecoder, loaded), [reqs], steps_between=0)
    dec = _with_runner(_decoder(SlotDecoder, loaded, graphs="static"), runner)
    assert _drive(dec, [reqs], steps_between=0) == eager
    assert dec.graphs is not None and dec.graphs.disabled.startswith(reason)
    assert not dec.graphs.graphs and dec.graphs.pool is None  # dropped, not kept half-used


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (none on the dev machine)")
def test_cuda_graphs_capture_across_a_cache_growth_and_decode_like_the_static_step(smollm2: Any) -> None:
    from aerie.engine.server.loader import load_model

    packed.register()
    gpu = load_model(smollm2.path, "cuda", "float32", skip_tokenizer=False)
    waves = _growing_waves(gpu)

    static = _drive(_decoder(SlotDecoder, gpu, device="cuda", graphs="static"), waves, steps_between=2)
    graphed = _decoder(SlotDecoder, gpu, device="cuda", graphs="cuda")
    assert isinstance(graphed, SlotDecoder)
    assert _drive(graphed, waves, steps_between=2) == static
    assert graphed.graphs is not None and graphed.graphs.disabled == ""
    assert graphed.graphs.captured == 3 and list(graphed.graphs.graphs) == [512, 256]
