"""Reference-server pieces that need no model: packing plans, the dump file contract, sampling filters,
and the scheduler loop driven by a run-to-completion backend (the speculative-decoding seam)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aerie.engine.generation import (
    GenRequest,
    GenResult,
    RunToCompletionBackend,
    SamplingParams,
    _filtered_probs,
)
from aerie.engine.server.dump import check_rid, write_dump
from aerie.engine.server.extraction import Capture
from aerie.engine.server.packed import make_pack, plan_packs
from aerie.engine.server.scheduler import Scheduler


def test_plan_packs_respects_the_budget_and_keeps_order() -> None:
    assert plan_packs([3, 4, 2, 9, 1], 8) == [[0, 1], [2], [3], [4]]
    assert plan_packs([10], 4) == [[0]]  # a sequence longer than the budget goes alone
    packs = plan_packs([5, 1, 1, 1, 7, 2], 8)
    assert [i for p in packs for i in p] == list(range(6))


def test_make_pack_restarts_positions_per_sequence() -> None:
    pack = make_pack([[7, 8, 9], [5], [1, 2]], "cpu")
    assert pack.input_ids.tolist() == [[7, 8, 9, 5, 1, 2]]
    assert pack.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert pack.cu_seqlens.tolist() == [0, 3, 4, 6] and pack.max_len == 3 and pack.lengths == [3, 1, 2]


@pytest.mark.parametrize("rid", ["a", "train-000123", "x.y_z-1"])
def test_safe_rids(rid: str) -> None:
    assert check_rid(rid) is None


@pytest.mark.parametrize("rid", ["", ".hidden", "-x", "a/b", "../up", "a..b", "sp ace", "x" * 201])
def test_unsafe_rids(rid: str) -> None:
    assert check_rid(rid) is not None


def _capture(t: int = 4, h: int = 3, dtype: torch.dtype = torch.bfloat16) -> Capture:
    return Capture(
        input_ids=torch.arange(t, dtype=torch.int32),
        aux_hidden=torch.randn(t, 3 * h).to(dtype),
        last_hidden=torch.randn(t, h).to(dtype),
    )


def test_write_dump_contract(tmp_path: Path) -> None:
    cap = _capture()
    meta = write_dump(tmp_path, "r1", cap, {"rid": "r1"})
    assert meta == {
        "key": "r1.safetensors",
        "shapes": {"input_ids": [4], "aux_hidden": [4, 9], "last_hidden": [4, 3]},
        "dtype": "bfloat16",
    }
    back = load_file(tmp_path / "r1.safetensors")
    assert torch.equal(back["aux_hidden"], cap.aux_hidden) and back["input_ids"].dtype == torch.int32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r1.safetensors"]


def test_a_failed_write_leaves_neither_the_file_nor_its_temp(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="metadata|str"):
        write_dump(tmp_path, "r2", _capture(), {"bad": 1})  # type: ignore[dict-item]
    assert list(tmp_path.iterdir()) == []


def test_sampling_filters() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])
    top_k = _filtered_probs(logits, [SamplingParams(top_k=2), SamplingParams(top_p=0.5)])
    assert (top_k[0, 2:] == 0).all() and top_k[0, :2].sum().item() == pytest.approx(1.0)
    assert top_k[1].tolist()[0] == pytest.approx(1.0)  # top-p 0.5 keeps only the 64%-likely token
    cold = _filtered_probs(logits[:1], [SamplingParams(temperature=0.05)])
    assert cold[0, 0].item() > 0.99


def _echo(requests: Sequence[GenRequest]) -> list[GenResult]:
    """A stand-in decoder (no model): 'generates' the prompt reversed, truncated to max_new_tokens."""
    return [
        GenResult(r, list(reversed(r.input_ids))[: r.params.max_new_tokens], {"type": "length", "length": 0})
        for r in requests
    ]


def test_scheduler_runs_a_run_to_completion_backend() -> None:
    backend = RunToCompletionBackend(_echo, max_batch=2)
    scheduler = Scheduler(backend, None, None, max_batch_tokens=64)
    scheduler.start()
    try:
        requests = [
            GenRequest(f"r{i}", [i, i + 1, i + 2], SamplingParams(max_new_tokens=2)) for i in range(5)
        ]
        futures = scheduler.submit_generations(requests)
        results = [f.result(timeout=10) for f in futures]
    finally:
        scheduler.stop()
    assert [r.output_ids for r in results] == [[i + 2, i + 1] for i in range(5)]
    assert [r.request.rid for r in results] == [f"r{i}" for i in range(5)]
    assert scheduler.stats.peak_running <= 2


def test_a_failing_backend_fails_its_requests_not_the_worker() -> None:
    calls: list[int] = []

    def flaky(requests: Sequence[GenRequest]) -> list[GenResult]:
        calls.append(len(requests))
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return _echo(requests)

    scheduler = Scheduler(RunToCompletionBackend(flaky, max_batch=1), None, None, max_batch_tokens=64)
    scheduler.start()
    try:
        first = scheduler.submit_generations([GenRequest("a", [1, 2], SamplingParams(max_new_tokens=1))])[0]
        with pytest.raises(RuntimeError, match="device lost"):
            first.result(timeout=10)
        second = scheduler.submit_generations([GenRequest("b", [3, 4], SamplingParams(max_new_tokens=1))])[0]
        assert second.result(timeout=10).output_ids == [4]
    finally:
        scheduler.stop()
    assert scheduler.stats.failures == 1


def test_a_float32_model_never_reaches_the_half_only_varlen_kernel(monkeypatch) -> None:
    """The packed backend is chosen per process on the first model's probe (a bf16 server on CUDA picks
    varlen); a float32 model in the same process takes the segment loop instead of failing in the kernel
    (seen on an H200: "FlashAttention only support fp16 and bf16 data type")."""
    from aerie.engine.server import packed

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 12, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 5, 12])
    monkeypatch.setitem(packed._backend, "name", "loop")
    want, _ = packed.packed_attention_forward(None, q, k, v, None, cu_seq_lens_q=cu, max_length_q=7)
    monkeypatch.setitem(packed._backend, "name", "varlen")
    got, _ = packed.packed_attention_forward(None, q, k, v, None, cu_seq_lens_q=cu, max_length_q=7)
    assert torch.equal(got, want)


def test_trace_summary_counts_busy_time_and_gaps_per_stream() -> None:
    """Two streams: kernels overlapping on one (counted once), a 30 us and a 5 us gap (only gaps of
    20 us and more are waiting), a copy alone on the other."""
    from aerie.engine.server.trace import summarize

    def span(ts: float, dur: float, name: str, tid: int, cat: str = "kernel") -> dict:
        return {"ph": "X", "ts": ts, "dur": dur, "name": name, "tid": tid, "cat": cat}

    trace = {
        "traceEvents": [
            span(0, 200, "aten::linear", 1, "cpu_op"),
            span(10, 40, "gemm", 7),
            span(30, 30, "norm", 7),  # overlaps gemm: busy 10..60
            span(90, 10, "add", 7),  # a 30 us gap after norm
            span(105, 20, "gemm", 7),  # a 5 us gap: launch latency, not counted
            span(50, 100, "Memcpy DtoH", 9, "gpu_memcpy"),
            {"ph": "i", "ts": 5, "name": "marker"},
        ]
    }
    out = summarize(trace)
    assert out["wall_us"] == 200.0
    compute = out["streams"]["7"]
    assert compute["busy_us"] == 50 + 10 + 20 and compute["events"] == 4
    assert compute["gaps_over_20us"] == 1 and compute["gap_us_total"] == 30.0
    assert compute["longest_gaps"] == [{"us": 30.0, "after": "norm"}]
    assert out["streams"]["9"]["busy_share_of_wall"] == 0.5
    assert summarize({"traceEvents": []}) == {"wall_us": 0.0, "streams": {}}


@pytest.mark.parametrize("spec", ["3", "a:b", "-1:2", "2:0"])
def test_trace_packs_must_be_skip_colon_count(spec: str) -> None:
    from aerie.engine.server.args import parse_packs

    with pytest.raises(ValueError, match="--trace-packs"):
        parse_packs(spec)
    assert parse_packs("8:4") == (8, 4)
