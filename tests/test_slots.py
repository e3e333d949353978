"""The slot decoder against the plain batched decoder, on the real embedded target in float32.

Rule under test: greedy decoding gives the same tokens whether a request runs alone, in a batch, or
joins a batch mid-flight while others finish and rows are moved (the slot decoder's row moves and
scattered K/V writes are where it could go wrong).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from aerie.refserver import packed
from aerie.refserver.generation import BatchedDecoder, GenRequest, GenResult, SamplingParams
from aerie.refserver.slots import KVSlots, SlotDecoder, supports

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
    from aerie.refserver.loader import load_model

    packed.register()
    return load_model(smollm2.path, "cpu", "float32", skip_tokenizer=False)


def _decoder(cls: type[BatchedDecoder], loaded: Any, max_running: int = 8, **extra: Any) -> BatchedDecoder:
    return cls(
        loaded.model,
        loaded.tokenizer,
        eos_token_ids=loaded.eos_token_ids,
        device="cpu",
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
