"""The parallel commit path (`ShardCommitter`) against the serial one (`ShardWriter.add`).

Same samples in, the very same shard files out (names, bytes, sha256, row ranges) for any number of
encode threads; an interruption keeps a chain of whole shards from which a resumed run rebuilds the
rest exactly; back-pressure holds the submitter; failures surface with where they happened.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from pathlib import Path

import pytest
import torch

from aerie.errors import ExtractionError
from aerie.extract.commit import ShardCommitter, default_workers
from aerie.extract.config import ExtractConfig
from aerie.fp8 import quantize_fp8
from aerie.shards.format import HiddenSample, ShardInfo
from aerie.shards.reader import ShardReader
from aerie.shards.schema import bytes_per_token
from aerie.shards.writer import ShardWriter

H = 32


def make_samples(n: int, seed: int = 0) -> list[HiddenSample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = int(torch.randint(1, 90, (1,), generator=gen))
        aux = torch.randn(t, 3 * H, generator=gen) * torch.rand(t, 1, generator=gen) * 40
        aux[0] *= 0  # a zero row: scale 1
        out.append(
            HiddenSample(
                id=f"r{i}",
                input_ids=torch.randint(0, 50_000, (t,), generator=gen),
                loss_mask=torch.rand(t, generator=gen) > 0.3,
                aux_hidden=aux.to(torch.bfloat16),
                last_hidden=torch.randn(t, H, generator=gen).to(torch.bfloat16),
            )
        )
    return out


def writer(out: Path, storage: str, first_index: int = 0) -> ShardWriter:
    # ~ 4 KB fp8 / 8 KB bf16 shards: a few samples each, many shards.
    return ShardWriter(
        out,
        storage=storage,  # type: ignore[arg-type]
        shard_bytes=40 * bytes_per_token(storage, H),  # type: ignore[arg-type]
        hidden_size=H,
        prefix="shard-s0",
        first_index=first_index,
    )


def serial(out: Path, storage: str, samples: list[HiddenSample]) -> list[tuple[ShardInfo, int, int]]:
    """ShardWriter.add, one thread: the reference layout, with each shard's row range."""
    w = writer(out, storage)
    closed, first = [], 0
    for row, s in enumerate(samples):
        if (info := w.add(s)) is not None:
            closed.append((info, first, row))
            first = row
    if (info := w.close()) is not None:
        closed.append((info, first, len(samples)))
    return closed


class Collect:
    def __init__(self) -> None:
        self.closed: list[tuple[ShardInfo, int, int]] = []
        self.tokens = 0
        self.threads: set[str] = set()

    def on_closed(self, info: ShardInfo, first: int, end: int) -> None:
        self.closed.append((info, first, end))
        self.threads.add(threading.current_thread().name)

    def on_appended(self, tokens: int) -> None:
        self.tokens += tokens


def committer(w: ShardWriter, sink: Collect, *, workers: int, first_row: int = 0, **kw) -> ShardCommitter:
    return ShardCommitter(
        w,
        first_row=first_row,
        workers=workers,
        max_pending_tokens=kw.pop("max_pending_tokens", 200),
        on_closed=sink.on_closed,
        on_appended=sink.on_appended,
        **kw,
    )


def layout(closed: list[tuple[ShardInfo, int, int]]) -> list[tuple]:
    return [(i.name, i.samples, i.tokens, i.bytes, i.sha256, first, end) for i, first, end in closed]


def commit_all(c: ShardCommitter, samples: list) -> None:
    """Submit every sample, finish, and always stop the committer's threads."""
    try:
        for s in samples:
            c.submit(s)
        c.finish()
    finally:
        c.close()


def quantized(samples: list[HiddenSample]) -> list[HiddenSample]:
    """The samples as a server quantizing its dumps hands them over: fp8 codes and their scales."""
    out = []
    for s in samples:
        aux, aux_s = quantize_fp8(s.aux_hidden, groups=3)
        last, last_s = quantize_fp8(s.last_hidden, groups=1)
        out.append(
            dataclasses.replace(s, aux_hidden=aux, last_hidden=last, aux_scale=aux_s, last_scale=last_s)
        )
    return out


@pytest.mark.parametrize("arrive", ["bf16 into fp8", "fp8 from the server", "bf16 into bf16"])
def test_batches_handed_over_at_once_write_the_serial_shards(tmp_path, arrive):
    """`submit_many` takes a request's samples in one hand-off, and samples that need no encoding
    bypass the encode pool: the shards are still the serial writer's, wherever batches and shards
    cut the rows."""
    storage = "bf16" if arrive == "bf16 into bf16" else "fp8"
    samples = make_samples(40)
    if arrive == "fp8 from the server":
        samples = quantized(samples)
    want = serial(tmp_path / "serial", storage, samples)
    sink = Collect()
    c = committer(writer(tmp_path / "par", storage), sink, workers=2, max_pending_tokens=500)
    try:
        for lo, hi in [(0, 1), (1, 9), (9, 10), (10, 27), (27, 40)]:
            c.submit_many(samples[lo:hi])
        c.finish()
    finally:
        c.close()
    assert layout(sink.closed) == layout(want)
    assert sink.tokens == sum(s.tokens for s in samples)
    # Only quantizing on the client keeps the pool busy.
    assert (c.busy()["encode"] > 0) == (arrive == "bf16 into fp8")


@pytest.mark.parametrize("storage", ["fp8", "bf16"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_parallel_commit_writes_the_serial_shards_byte_for_byte(tmp_path, storage, workers):
    samples = make_samples(40)
    want = serial(tmp_path / "serial", storage, samples)
    assert len(want) > 5  # many shard boundaries
    sink = Collect()
    # encode_rows=16: samples longer than that are encoded in row ranges by several threads.
    c = committer(writer(tmp_path / "par", storage), sink, workers=workers, encode_rows=16)
    commit_all(c, samples)
    assert layout(sink.closed) == layout(want)
    for (got, _, _), (ref, _, _) in zip(sink.closed, want, strict=True):
        assert got.path.read_bytes() == ref.path.read_bytes()
    assert sink.tokens == sum(s.tokens for s in samples) and c.next_row == len(samples)
    assert sink.threads == {"aerie-commit-sync_0"}  # shards are reported in order, from one thread
    # and they read back as the samples, in row order
    ids = [sid for info, _, _ in sink.closed for sid in ShardReader(info.path).sample_ids]
    assert ids == [s.id for s in samples]


def test_busy_times_say_where_the_commit_path_spent_its_time(tmp_path):
    """Every step's seconds are counted, on the thread that spent them: encode in the pool, the
    write thread's time split into its data, hash-wait and fsync parts, the callback apart."""
    samples = make_samples(40, seed=6)
    sink = Collect()

    def slow_on_closed(info: ShardInfo, first: int, end: int) -> None:
        time.sleep(0.01)  # e.g. waiting for an upload slot: counted as on_closed, not as write
        sink.on_closed(info, first, end)

    c = ShardCommitter(
        writer(tmp_path, "fp8"),
        first_row=0,
        workers=2,
        max_pending_tokens=200,
        on_closed=slow_on_closed,
        encode_rows=16,
    )
    commit_all(c, samples)
    busy, counts = c.busy(), c.counts()
    assert set(busy) == {
        "encode", "append_wait_encode", "append", "write_slot_wait", "write",
        "write_data", "sync_slot_wait", "sync", "write_hash_wait", "write_fsync", "on_closed",
    }  # fmt: skip
    assert all(v >= 0 for v in busy.values())
    assert busy["encode"] > 0 and busy["append"] > 0 and busy["write"] > 0 and busy["write_fsync"] > 0
    assert busy["write_data"] <= busy["write"] and busy["sync"] > 0
    assert busy["write_hash_wait"] + busy["write_fsync"] <= busy["sync"] + 1e-6
    assert busy["on_closed"] >= 0.01 * len(sink.closed)
    assert counts == {"shards": len(sink.closed), "shard_bytes": sum(i.bytes for i, _, _ in sink.closed)}
    # Each shard's info carries its own write's split (not part of its identity or its record).
    info = sink.closed[0][0]
    assert info.timing.fsync > 0 and "timing" not in info.record()


def test_an_interrupted_commit_resumes_into_exactly_the_serial_shards(tmp_path):
    """Close without finishing (a slice that fails): what was reported is a chain of whole shards
    from row 0; a fresh committer started after its end row, with the next shard index, writes the
    rest, and together they are the uninterrupted run's shards, every sample exactly once."""
    samples = make_samples(60, seed=3)
    want = serial(tmp_path / "serial", "fp8", samples)
    out = tmp_path / "run"
    first = Collect()
    c = committer(writer(out, "fp8"), first, workers=2)
    try:
        for s in samples[:37]:
            c.submit(s)
        c.drain()  # a failing slice drains what it committed before giving up
    finally:
        c.close()
    assert first.closed and len(first.closed) < len(want)
    assert layout(first.closed) == layout(want)[: len(first.closed)]
    assert not list(out.glob(".*.tmp"))  # no half-written file left behind

    # The resume point, as progress.json gives it: the end row of the last shard, the next index.
    row, index = first.closed[-1][2], len(first.closed)
    second = Collect()
    c = committer(writer(out, "fp8", first_index=index), second, workers=3, first_row=row)
    try:
        for s in samples[row:]:
            c.submit(s)
        c.finish()
    finally:
        c.close()
    assert layout(first.closed + second.closed) == layout(want)
    ids = [sid for info, _, _ in first.closed + second.closed for sid in ShardReader(info.path).sample_ids]
    assert ids == [s.id for s in samples]
    tokens = sum(ShardReader(info.path).tokens for info, _, _ in first.closed + second.closed)
    assert tokens == sum(s.tokens for s in samples)


def test_close_without_drain_drops_the_queue_but_never_half_a_shard(tmp_path):
    samples = make_samples(30, seed=4)
    want = serial(tmp_path / "serial", "bf16", samples)
    out = tmp_path / "run"
    sink = Collect()
    c = committer(writer(out, "bf16"), sink, workers=2)
    for s in samples:
        c.submit(s)
    c.close()  # e.g. KeyboardInterrupt: no drain
    # Whatever was written is a prefix of the serial shards, each file whole and as reported.
    assert layout(sink.closed) == layout(want)[: len(sink.closed)]
    for info, _, _ in sink.closed:
        assert hashlib.sha256(info.path.read_bytes()).hexdigest() == info.sha256
    assert sorted(p.name for p in out.iterdir()) == [i.name for i, _, _ in sink.closed]


def test_submit_blocks_while_the_pipeline_is_full(tmp_path):
    samples = make_samples(8, seed=5)
    slow = Collect()

    def on_appended(tokens: int) -> None:
        time.sleep(0.05)  # a slow append side: the submitter must wait for it
        slow.on_appended(tokens)

    c = ShardCommitter(
        writer(tmp_path, "fp8"),
        first_row=0,
        workers=2,
        max_pending_tokens=1,  # one sample at a time
        on_closed=slow.on_closed,
        on_appended=on_appended,
    )
    try:
        began = time.monotonic()
        for s in samples:
            c.submit(s)
        submitted = time.monotonic() - began
        c.finish()
    finally:
        c.close()
    # 8 samples, each admitted only once the one before it was appended (50 ms each).
    assert submitted >= 0.3 and c.waited_s >= 0.3
    assert slow.tokens == sum(s.tokens for s in samples)


def test_a_shard_that_cannot_be_written_fails_the_next_call_naming_it(tmp_path):
    out = tmp_path / "shards"
    w = writer(out, "fp8")
    out.rmdir()
    out.write_text("not a directory")  # every shard write now fails (as a full or broken disk would)
    sink = Collect()
    c = committer(w, sink, workers=2)
    try:
        with pytest.raises(ExtractionError, match=r"cannot write shard .*shard-s0-00000\.safetensors"):
            for s in make_samples(40):
                c.submit(s)
            c.finish()
        assert c.failed and not sink.closed
    finally:
        c.close()


def test_a_failure_while_a_shard_syncs_drops_the_next_written_shard(tmp_path):
    """The next shard's bytes are written while one is fsynced and reported. When reporting fails
    (e.g. the store refused it), that written shard is dropped with the rest: no temp file stays,
    no later shard is reported, and the failure names its cause."""
    out = tmp_path / "run"
    synced: list[str] = []

    def refuse(info: ShardInfo, first: int, end: int) -> None:
        synced.append(info.name)
        time.sleep(0.3)  # the write thread meanwhile writes the next shard and waits to sync it
        raise RuntimeError("the store refused it")

    c = ShardCommitter(writer(out, "bf16"), first_row=0, workers=2, max_pending_tokens=200, on_closed=refuse)
    try:
        with pytest.raises(ExtractionError, match="RuntimeError: the store refused it"):
            for s in make_samples(40):
                c.submit(s)
            c.finish()
    finally:
        c.close()
    # Proof the next shard had been written: its wait for the sync slot covers the callback's sleep.
    assert c.busy()["sync_slot_wait"] >= 0.2
    assert synced == ["shard-s0-00000.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == ["shard-s0-00000.safetensors"]


def test_a_bad_sample_is_refused_at_submit(tmp_path):
    c = committer(writer(tmp_path, "fp8"), Collect(), workers=1)
    bad = make_samples(1)[0]
    bad.aux_hidden = bad.aux_hidden[:, :H]
    try:
        with pytest.raises(ExtractionError, match="aux_hidden has shape"):
            c.submit(bad)
        assert c.next_row == 0
    finally:
        c.close()


def test_encode_threads_run_torch_single_threaded_and_leave_the_caller_alone(tmp_path):
    before = torch.get_num_threads()
    c = committer(writer(tmp_path, "fp8"), Collect(), workers=2)
    try:
        seen = {c._encode.submit(torch.get_num_threads).result() for _ in range(8)}
        assert seen == {1}
        assert torch.get_num_threads() == before
        # A thread started afterwards gets torch's global count, not the pool's.
        other: list[int] = []
        t = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert other == [before]
    finally:
        c.close()


def test_commit_workers_default_from_the_host(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert default_workers(1) == 8 and default_workers(2) == 4 and default_workers(16) == 1
    assert ExtractConfig().resolved_commit_workers() == 8
    assert ExtractConfig(num_servers=4).resolved_commit_workers() == 2
    assert ExtractConfig(commit_workers=3).resolved_commit_workers() == 3
    monkeypatch.setattr("os.cpu_count", lambda: 256)
    assert default_workers(1) == 16
    with pytest.raises(ValueError, match="commit_workers"):
        ExtractConfig(commit_workers=0)
