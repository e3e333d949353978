"""The extraction stage end to end through real reference servers (processes on 127.0.0.1).

One scenario, because each server start costs ~10-20 s on a busy 2-core machine:
1. two servers (fan-out), fp8 storage, canary with the numeric reference check; server s0 is killed
   with SIGKILL mid-extraction and max_restarts=0, so the run fails, keeping the uploaded shards;
2. the re-run (same stage key: max_restarts is not part of it) resumes after those shards; server s0
   is SIGKILLed during its canary and again mid-extraction, and restarted both times; the run completes with every corpus sample exactly once, in order,
   the token ids and loss masks of the corpus, and hidden states matching a transformers forward;
3. a third run is a cache hit;
4. the servers quantize to fp8 (`quantize_on_server`): the same stage key and the same shards, byte
   for byte (one quantization function on the same float32 states, CPU on both sides).
"""

from __future__ import annotations

import pytest
import torch

from aerie.errors import ExtractionError
from aerie.extract import work
from aerie.extract.canary import reference_hidden_states
from aerie.extract.config import ExtractConfig
from aerie.extract.phases import COMMIT_PATH
from aerie.extract.resume import ProgressFile
from aerie.manifest import load_manifest
from aerie.serving import ServerConfig
from aerie.shards.reader import ShardReader
from aerie.store import LocalStore
from tests.extract_support import KillServer, corpus_rows, listener_pid, write_corpus
from tests.processes import free_port_pair
from tests.stage_work import staged

run = staged("extract", work.run)

pytestmark = pytest.mark.integration  # reference server processes


def check_commit_path(phases: dict) -> dict[str, float]:
    """The commit path's busy seconds of one slice's figures (`aerie.extract.phases`): every step
    present and >= 0, some time spent encoding and writing, the write's parts within it (each rounded to
    the millisecond). Returns the seconds by step."""
    busy = {name: p["s"] for name, p in phases["commit_path"].items()}
    assert list(busy) == list(COMMIT_PATH) and all(v >= 0 for v in busy.values())
    # Each step is rounded to the millisecond, so one tiny step may read 0.0 (CI saw append 0.0 for a
    # slice of a few rows); the path as a whole must have taken time, and the counts say it did work.
    assert busy["encode"] + busy["append"] + busy["write"] > 0
    assert busy["write_data"] <= busy["write"] + 0.001
    assert busy["write_hash_wait"] + busy["write_fsync"] <= busy["sync"] + 0.002
    counts = phases["commit_counts"]
    assert counts["shards"] >= 1 and counts["shard_bytes"] > 0 and counts["uploads"] >= 0
    return busy


@pytest.mark.slow
def test_fanout_kill9_resume_exact_counts(tmp_path, smollm2):
    store = LocalStore(tmp_path / "store")
    tok = smollm2.load_tokenizer()
    rows = corpus_rows(tok, 44, min_words=6, max_words=24)
    splits = {"train": rows[:38], "eval": rows[38:]}
    corpus = write_corpus(store, "t", splits, rows_per_shard=10)
    port = free_port_pair()
    server = ServerConfig(backend="reference", device="cpu", port=port)
    cfg = ExtractConfig(
        storage_dtype="fp8",
        shard_bytes=1 << 18,  # ~110 tokens of fp8 at H=576: a few samples per shard
        batch_tokens=96,
        requests_in_flight=2,
        num_servers=2,
        max_restarts=0,
        commit_workers=2,  # the parallel commit path, through both kills and the resume
        work_dir=str(tmp_path / "work"),
        delete_local_after_upload=True,
        dump_timeout_s=60,
    )

    # 1. s0 dies, no restart allowed: the stage fails, uploaded shards are kept.
    kill0 = KillServer(port, 0.3)
    with pytest.raises(ExtractionError, match="max_restarts=0 is used up"):
        run(cfg, store=store, run_name="t", target=smollm2, corpus=corpus, server=server, progress=kill0)
    assert len(kill0.killed) == 1
    prefix = next(p for p in {k.rsplit("/", 1)[0] for k in store.list("t/extract")} if p.count("/") == 2)
    kept = ProgressFile(store, f"{prefix}/progress.json").shards
    assert kept, "no shard was uploaded before the kill"
    assert not listener_pid(port) and not listener_pid(port + 1)  # both servers torn down

    # 2. Re-run with two restarts allowed: resumes after the kept shards. s0 (the slice with the most
    # left to do) is killed while its canary runs (a crash, not a wrong canary: restarted), then again at
    # the first progress report once its restart is extracting (the commit path holds at most a batch
    # more than it reported, so s0 still has requests to make), and restarted.
    cfg2 = cfg.model_copy(update={"max_restarts": 2})
    kill1 = KillServer(port, "canary", 0.0)
    result = run(
        cfg2, store=store, run_name="t", target=smollm2, corpus=corpus, server=server, progress=kill1
    )
    assert result.prefix == prefix and not result.cache_hit
    assert len(kill1.killed) == 2
    figures = result.figures
    assert figures["server_restarts"] == 2
    assert figures["resumed_rows"] >= sum(s.samples for s in kept)
    corpus_tokens = {s: sum(len(r["input_ids"]) for r in rs) for s, rs in splits.items()}
    assert (
        figures["train_tokens"] == corpus_tokens["train"] and figures["eval_tokens"] == corpus_tokens["eval"]
    )
    assert figures["samples"] == len(rows)
    assert 0 < figures["commit_share"] < 1  # packing shards took part of the extraction time
    # Where each server's steady time went: the client's phases are its wall (other >= 0), and the
    # restarted s0's server reported its phases over the pump that completed on it.
    # s1 may have finished its slice in run 1 (the failure stops it only at its next batch; CI saw it
    # finish on a loaded machine): then it had nothing left to pump here.
    by_slice = figures["phases_by_slice"]
    assert set(by_slice) in ({"s0"}, {"s0", "s1"}) and figures["phases"] in by_slice.values()
    for phases in by_slice.values():
        client = phases["client"]
        assert all(p["s"] >= 0 for name, p in client.items() if name != "other")
        assert client["other"]["s"] >= -0.01 and client["http_wait"]["s"] > 0
        assert phases["server"] is not None and phases["server"]["forward"]["s"] > 0
    # What the commit path behind each pump was busy with: fp8 quantized on the client, shards
    # written, and the uploader (taking the files over) busy within the pumps' windows.
    busy = [check_commit_path(phases) for phases in by_slice.values()]
    assert sum(b["upload"] for b in busy) > 0

    manifest = load_manifest(store, prefix)
    assert manifest["layers"] == {"input_of_layer": [2, 15, 27], "output_of_layer": [1, 14, 26]}
    assert manifest["storage_dtype"] == "fp8" and manifest["hidden_size"] == 576
    canary = manifest["canary"]
    assert canary["numeric"] is not None and [b["best"] for b in canary["numeric"]["blocks"]] == [2, 15, 27]
    assert canary["greedy_token"] == canary["lm_head_token"]

    # Every sample exactly once, in corpus order per slice, with the corpus's ids and masks.
    ref = {}
    for split, split_rows in splits.items():
        entries = manifest["splits"][split]["shards"]
        ids = []
        for entry in entries:
            path = store.local_path(f"{prefix}/{entry['path']}")
            assert path is not None
            reader = ShardReader(path, dtype=torch.float32)
            assert reader.tokens == entry["tokens"] and len(reader) == entry["samples"]
            for sample in reader:
                ids.append(sample.id)
                want = next(r for r in split_rows if r["id"] == sample.id)
                assert sample.input_ids.tolist() == want["input_ids"]
                assert sample.loss_mask.tolist() == [bool(m) for m in want["loss_mask"]]
                ref[sample.id] = sample
        assert ids == [r["id"] for r in split_rows]
    # The stored hidden states are the target's (fp8 rounding: <= 2^-4 of each token's max).
    probe = rows[5]
    hs = reference_hidden_states(smollm2, probe["input_ids"])
    got = ref[probe["id"]]
    want_aux = torch.cat([hs[i] for i in (2, 15, 27)], -1)
    err = (got.aux_hidden - want_aux).abs().amax(-1) / want_aux.abs().amax(-1)
    assert float(err.max()) < 0.08
    assert float(((got.last_hidden - hs[-1]).abs().amax(-1) / hs[-1].abs().amax(-1)).max()) < 0.08
    assert not list((tmp_path / "work").rglob("*.safetensors"))  # local copies deleted after upload

    # 3. Same inputs: a cache hit, nothing launched.
    again = run(cfg2, store=store, run_name="t", target=smollm2, corpus=corpus, server=server)
    assert again.cache_hit and again.manifest_sha256 == result.manifest_sha256

    # 4. The servers quantize (--dump-dtype fp8) instead of the client: the same stage key (so under
    # another run name, or it would be the cache hit above), and the same shards, byte for byte.
    cfg3 = cfg.model_copy(update={"quantize_on_server": True, "max_restarts": 0})
    quantized = run(cfg3, store=store, run_name="q", target=smollm2, corpus=corpus, server=server)
    assert quantized.prefix.rsplit("/", 1)[1] == prefix.rsplit("/", 1)[1]
    server_side = load_manifest(store, quantized.prefix)
    for split in splits:
        shards = [(e["name"], e["sha256"]) for e in server_side["splits"][split]["shards"]]
        assert shards == [(e["name"], e["sha256"]) for e in manifest["splits"][split]["shards"]]
    canary = server_side["canary"]  # the canary saw the fp8 dump, dequantized, and checked its layers
    assert canary["dtype"] == "float8_e4m3fn" and canary["numeric"]["rtol"] > cfg.canary_rtol
    assert [b["best"] for b in canary["numeric"]["blocks"]] == [2, 15, 27]
