"""Extraction pieces that need no server: preflight, batching, corpus order, resume, uploads, and the
canary's checks against a real transformers forward of the embedded target."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from aerie.errors import CanaryError, ExtractionError, IntegrityError, PreflightError
from aerie.extract import plan, preflight, work
from aerie.extract.canary import ExtractionCanary, _dequantized, compare_layers, reference_hidden_states
from aerie.extract.client import make_batches, to_sample
from aerie.extract.config import ExtractConfig
from aerie.extract.corpus_rows import Row, open_split, slice_bounds
from aerie.extract.phases import PhaseTotals, RequestTiming
from aerie.extract.resume import ClosedShard, ProgressFile
from aerie.extract.uploads import Uploader
from aerie.fp8 import quantize_fp8
from aerie.hostlock import HostLock
from aerie.serving import ServerConfig
from aerie.shards.format import HiddenSample
from aerie.shards.schema import bytes_per_token
from aerie.shards.writer import ShardWriter
from aerie.store import LocalStore
from tests.conftest import free_port
from tests.extract_support import corpus_rows, write_corpus
from tests.stage_work import staged

# ---- preflight -----------------------------------------------------------------------------------


def test_preflight_refuses_with_the_numbers(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    cfg = ExtractConfig(storage_dtype="bf16")
    # Kimi-K2.5's corpus: 87.8M tokens at hidden 7168 is ~5 TB in bf16; more than this disk.
    tokens = max(87_800_000, free // bytes_per_token("bf16", 7168) * 2)
    report = preflight.estimate(cfg, tokens=tokens, hidden_size=7168, work_dir=tmp_path / "w", store_dir=None)
    with pytest.raises(PreflightError) as err:
        preflight.check(report, cfg)
    msg = str(err.value)
    assert f"{tokens:,} tokens x 57,349 B/token (bf16)" in msg
    assert "only" in msg and "free" in msg and "short by" in msg
    assert "storage_dtype=fp8" in msg and "delete_local_after_upload=true" in msg
    # fp8 halves the estimate.
    fp8 = preflight.estimate(
        ExtractConfig(storage_dtype="fp8"), tokens=tokens, hidden_size=7168, work_dir=tmp_path, store_dir=None
    )
    assert fp8.shard_bytes_total < 0.51 * report.shard_bytes_total


def test_preflight_counts_store_and_local_copies_on_one_disk(tmp_path):
    cfg = ExtractConfig(shard_bytes=1 << 20, batch_tokens=1024, requests_in_flight=1)
    tokens = 10_000
    both = preflight.estimate(
        cfg, tokens=tokens, hidden_size=576, work_dir=tmp_path / "w", store_dir=tmp_path / "s"
    )
    (need,) = both.needs  # same filesystem: one entry with all parts
    shards = int(tokens * bytes_per_token("bf16", 576) * cfg.disk_margin)
    assert need.parts["local shards"] == shards and need.parts["shards in the store"] == shards
    assert preflight.check(both, cfg) is both
    lean = preflight.estimate(
        cfg.model_copy(update={"delete_local_after_upload": True}),
        tokens=tokens,
        hidden_size=576,
        work_dir=tmp_path / "w",
        store_dir=None,
    )
    assert lean.needs[0].parts["local shards"] == 2 * cfg.shard_bytes
    resumed = preflight.estimate(
        cfg, tokens=tokens, hidden_size=576, work_dir=tmp_path, store_dir=None, already_uploaded_bytes=shards
    )
    assert resumed.needs[0].parts["local shards"] == 0
    # SmolLM2's 49,152-token vocabulary: its ids are stored as uint16, 2 B/token less than int32 ids.
    narrow = preflight.estimate(
        cfg, tokens=tokens, hidden_size=576, vocab_size=49_152, work_dir=tmp_path, store_dir=None
    )
    assert narrow.bytes_per_token == both.bytes_per_token - 2 == bytes_per_token("bf16", 576, 49_152)


# ---- batching and corpus order -------------------------------------------------------------------


def test_batches_fill_up_to_the_token_budget_in_order():
    rows = [Row(i, f"r{i}", [1] * n, [1] * n) for i, n in enumerate([30, 30, 50, 200, 10, 10])]
    batches = list(make_batches(rows, batch_tokens=100, rid_prefix="train"))
    assert [[r.index for r in b.rows] for b in batches] == [[0, 1], [2], [3], [4, 5]]
    assert batches[0].rids == ["train-0", "train-1"]
    assert slice_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert slice_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize(("dump_ids", "position"), [([5, 6, 9, 8], 2), ([5, 6, 7], 3), ([5, 6, 7, 8, 4], 4)])
def test_a_dump_whose_ids_are_not_the_corpus_rows_is_refused_where_they_part(dump_ids, position):
    """The client checks every dump's token ids against the corpus row it sent: a server that
    prefilled something else is named with the row, the counts and the first differing position."""
    row = Row(index=7, id="s7", input_ids=[5, 6, 7, 8], loss_mask=[0, 1, 1, 0])

    def dump(ids: list[int]) -> dict[str, torch.Tensor]:
        t = len(ids)
        return {
            "input_ids": torch.tensor(ids, dtype=torch.int32),
            "aux_hidden": torch.zeros(t, 6),
            "last_hidden": torch.zeros(t, 2),
        }

    with pytest.raises(
        ExtractionError, match=rf"r7: .* row 7 \(s7\) holds {len(dump_ids)} .* at position {position}"
    ):
        to_sample(row, dump(dump_ids), "r7")
    sample = to_sample(row, dump([5, 6, 7, 8]), "r7")
    assert sample.input_ids.tolist() == [5, 6, 7, 8] and sample.loss_mask.tolist() == [0, 1, 1, 0]


def test_pump_waits_are_split_by_the_step_the_awaited_request_was_in():
    # A request created at 0, started at 1, replied at 5, dumps visible at 6, read at 8, checked at 9.
    timing = RequestTiming(created=0.0, began=1.0, replied=5.0, dumps_found=6.0, read=8.0, done=9.0)
    phases = PhaseTotals()
    phases.waited_on(timing, began=3.0, ended=9.5)  # the pump turned to it late; resumed 0.5 s after done
    phases.committed(2.0)
    assert phases.client == {
        "queued": 0.0,
        "http_wait": 2.0,
        "dump_wait": 1.0,
        "read_dumps": 2.0,
        "check": 1.0,
        "commit": 2.0,
    }
    figures = phases.figures(wall=10.0)
    assert figures["client"]["other"] == {"s": 2.0, "share": 0.2}  # 10 - 8 named
    assert figures["client"]["http_wait"]["share"] == 0.2 and figures["server"] is None
    # The server's phases are deltas between the reads at either end of each pump; a pump whose end
    # read failed (the server died) adds nothing and is counted; a server that reports none is None.
    phases.server_window({"wall": 10.0, "forward": 4.0}, {"wall": 18.0, "forward": 10.0})
    phases.server_window({"wall": 1.0, "forward": 0.5}, None)
    phases.server_window(None, None)
    assert phases.server == {"wall": 8.0, "forward": 6.0} and phases.server_windows_missed == 1
    figures = PhaseTotals.from_record(phases.record()).figures(wall=10.0)
    assert figures["server"] == {"forward": {"s": 6.0, "share": 0.6}} and figures["server_window_s"] == 8.0
    assert figures["server_windows_missed"] == 1
    assert figures["commit_path"] is None  # nothing of the commit path recorded
    # The commit path's busy seconds add up over committers and windows, keep the pipeline's order,
    # and their shares are of the same wall; a record without them (older) still loads.
    phases.commit_busy({"upload": 1.0}, {"uploads": 2})
    phases.commit_busy({"encode": 3.0, "write": 2.0}, {"shards": 1})
    phases.commit_busy({"encode": 1.0, "upload": 0.5}, {"uploads": 1})
    back = PhaseTotals.from_record(phases.record())
    assert back == phases and list(back.commit_path) == ["upload", "encode", "write"]
    figures = back.figures(wall=10.0)
    assert list(figures["commit_path"]) == ["encode", "write", "upload"]
    assert figures["commit_path"]["encode"] == {"s": 4.0, "share": 0.4}
    assert figures["commit_path"]["upload"] == {"s": 1.5, "share": 0.15}
    assert list(figures["commit_counts"].items()) == [("shards", 1), ("uploads", 3)]
    old = {k: v for k, v in phases.record().items() if not k.startswith("commit_")}
    assert PhaseTotals.from_record(old).figures(wall=10.0)["commit_path"] is None


def test_corpus_split_in_manifest_order_and_from_any_row(tmp_path, smollm2):
    store = LocalStore(tmp_path / "store")
    rows = corpus_rows(smollm2.load_tokenizer(), 20)
    result = write_corpus(store, "t", {"train": rows[:17], "eval": rows[17:]}, rows_per_shard=5)
    train = open_split(store, result.prefix, "train", tmp_path / "cache")
    assert train.rows == [5, 5, 5, 2] and train.total_rows == 17
    assert train.tokens == sum(len(r["input_ids"]) for r in rows[:17])
    tail = list(train.iter_rows(7, 12))
    assert [r.index for r in tail] == list(range(7, 12))
    assert [r.id for r in tail] == [r["id"] for r in rows[7:12]]
    assert tail[0].input_ids == rows[7]["input_ids"] and tail[0].loss_mask == rows[7]["loss_mask"]
    # Without the manifest's list, files are found by name and counted from the parquet.
    manifest = store.local_path(f"{result.prefix}/manifest.json")
    manifest.unlink()
    again = open_split(store, result.prefix, "train", tmp_path / "cache")
    assert again.rows == train.rows and again.tokens == train.tokens
    assert open_split(store, result.prefix, "eval", tmp_path / "cache").total_rows == 3


@pytest.mark.integration
def test_a_second_process_on_the_same_slice_is_refused_before_any_server_starts(tmp_path, smollm2):
    """Its servers would wipe the running extraction's dump dirs as they start. The lock is a real
    flock: this test holds it as another process would (a second open file description conflicts
    like another process's), so the stage must refuse, naming the holder's pid; once released, a
    stale lock file blocks nothing."""
    store = LocalStore(tmp_path / "store")
    corpus = write_corpus(store, "t", {"train": corpus_rows(smollm2.load_tokenizer(), 4)}, rows_per_shard=4)
    cfg = ExtractConfig(work_dir=str(tmp_path / "work"), splits=["train"])
    server = ServerConfig(backend="reference", device="cpu", port=free_port())
    p = staged("extract", plan.plan)(
        cfg, store=store, run_name="t", target=smollm2, corpus=corpus, server=server
    )
    held = rf"another process \(pid {os.getpid()}\) is extracting {p.stage_dir.prefix} with servers s0-s0"
    with HostLock(p.work / ".lock-s0-s0"), pytest.raises(ExtractionError, match=held):
        staged("extract", work.run)(
            cfg, store=store, run_name="t", target=smollm2, corpus=corpus, server=server
        )
    assert not list((tmp_path / "work").rglob("*.log"))  # no server was launched
    with HostLock(p.work / ".lock-s0-s0"):  # the lock file is left behind, the lock is not
        pass


# ---- resume and uploads --------------------------------------------------------------------------


def _sample(i: int, t: int, h: int = 8) -> HiddenSample:
    return HiddenSample(
        id=f"s{i}",
        input_ids=torch.arange(t),
        loss_mask=torch.ones(t, dtype=torch.bool),
        aux_hidden=torch.randn(t, 3 * h),
        last_hidden=torch.randn(t, h),
    )


def _shard(index: int, first: int, end: int) -> ClosedShard:
    name = f"shard-s0-{index:05d}.safetensors"
    return ClosedShard("train", 0, index, name, f"shards/train/{name}", first, end, end - first, 1, 1, "x")


def test_resume_keeps_only_an_unbroken_chain_of_stored_shards(tmp_path):
    store = LocalStore(tmp_path)
    pf = ProgressFile(store, "r/extract/k/progress.json")
    for s in (_shard(0, 0, 4), _shard(1, 4, 9), _shard(2, 9, 12)):
        store.put_bytes(f"r/extract/k/{s.path}", b"x")
        pf.add(s)
    assert pf.resume_point("r/extract/k", "train", 0, 0)[:2] == (12, 3)
    store.delete("r/extract/k/shards/train/shard-s0-00001.safetensors")
    again = ProgressFile(store, "r/extract/k/progress.json")  # reloaded from the store
    row, index, kept = again.resume_point("r/extract/k", "train", 0, 0)
    assert (row, index, [s.index for s in kept]) == (4, 1, [0])
    # The broken tail is forgotten in the file too.
    assert [s.index for s in ProgressFile(store, "r/extract/k/progress.json").shards] == [0]
    assert again.resume_point("r/extract/k", "eval", 0, 100)[:2] == (100, 0)


def test_uploads_are_verified_recorded_and_local_copies_dropped(tmp_path):
    store = LocalStore(tmp_path / "store")
    pf = ProgressFile(store, "r/extract/k/progress.json")
    up = Uploader(store, "r/extract/k", pf, delete_local=True)
    w = ShardWriter(tmp_path / "local", storage="fp8", shard_bytes=1 << 20, hidden_size=8)
    w.add(_sample(0, 5))
    info = w.close()
    assert info is not None
    assert up.busy() == {"upload": 0.0} and up.counts() == {"uploads": 0}
    up.submit(info, _shard(0, 0, 1))
    (done,) = up.wait()
    assert done.index == 0 and not info.path.exists()
    assert up.busy()["upload"] > 0 and up.counts() == {"uploads": 1}  # its worker's time in it
    assert store.exists("r/extract/k/shards/train/shard-s0-00000.safetensors")
    assert [s.index for s in ProgressFile(store, "r/extract/k/progress.json").shards] == [0]
    # A shard changed on disk after it was written does not pass verification, and is not recorded.
    w.add(_sample(1, 5))
    info2 = w.close()
    assert info2 is not None
    data = bytearray(info2.path.read_bytes())
    data[-1] ^= 0xFF
    info2.path.write_bytes(bytes(data))
    up.submit(info2, _shard(1, 1, 2))
    with pytest.raises(IntegrityError, match="is corrupt"):
        up.wait()
    up.close()
    assert [s.index for s in ProgressFile(store, "r/extract/k/progress.json").shards] == [0]


# ---- canary checks against a real reference forward ----------------------------------------------


@pytest.fixture(scope="module")
def reference(smollm2):
    ids = smollm2.load_tokenizer()("Owls and tides: a short note on rivers, bread and maps.")["input_ids"]
    return ids, reference_hidden_states(smollm2, ids)


def test_canary_accepts_bf16_states_of_the_right_layers(smollm2, reference):
    ids, hs = reference
    aux = torch.cat([hs[i] for i in smollm2.aux_layers_input], -1).bfloat16()
    out = compare_layers(aux, hs[-1].bfloat16(), hs, smollm2.aux_layers_input, rtol=0.05)
    assert [b["best"] for b in out["blocks"]] == [2, 15, 27]


def test_canary_names_the_off_by_one_layer(smollm2, reference):
    ids, hs = reference
    # A server that captures the *outputs* of layers 2, 15, 27 (= inputs of 3, 16, 28).
    shifted = torch.cat([hs[i + 1] for i in smollm2.aux_layers_input], -1).bfloat16()
    with pytest.raises(
        CanaryError, match=r"aux block 0 matches hidden_states\[3\], not \[2\]: .* off by one"
    ):
        compare_layers(shifted, hs[-1], hs, smollm2.aux_layers_input, rtol=0.05)
    middle = torch.cat([hs[2], hs[16], hs[27]], -1)
    with pytest.raises(CanaryError, match=r"aux block 1 matches hidden_states\[16\], not \[15\]"):
        compare_layers(middle, hs[-1], hs, smollm2.aux_layers_input, rtol=0.05)


def test_canary_matching_no_layer_says_what_it_measured_not_an_offset(smollm2, reference):
    """States that agree with no layer (a broken forward) name the best match, its error and the
    tolerance; a layer offset would be a guess."""
    ids, hs = reference
    torch.manual_seed(0)
    noise = torch.cat(
        [hs[i] + 3 * torch.randn_like(hs[i]) * hs[i].std() for i in smollm2.aux_layers_input], -1
    )
    with pytest.raises(CanaryError) as err:
        compare_layers(noise, hs[-1], hs, smollm2.aux_layers_input, rtol=0.05)
    message = str(err.value)
    assert "matches no layer of the reference forward within tolerance" in message, message
    assert re.search(r"best match hidden_states\[\d+\] at rel err \d", message), message
    assert "tolerance canary_rtol 0.05" in message and "off by" not in message, message


def test_canary_catches_a_pre_norm_last_hidden(smollm2, reference):
    ids, hs = reference
    canary = ExtractionCanary(smollm2, Row(0, "c", ids, [1] * len(ids)), reference=False, rtol=0.05)
    aux = torch.cat([hs[i] for i in smollm2.aux_layers_input], -1)
    model_greedy = int(
        (hs[-1][-1] @ smollm2.load_model("cpu", "float32").get_output_embeddings().weight.T).argmax()
    )
    ok = canary.check(aux, hs[-1], model_greedy)
    assert ok.lm_head_token == model_greedy and "post-norm (lm_head argmax = greedy token)" in ok.checks
    pre_norm = hs[-2]  # the residual stream entering the last layer: not the lm_head input
    with pytest.raises(CanaryError, match="last_hidden is not the lm_head's input"):
        canary.check(aux, pre_norm, model_greedy)
    with pytest.raises(CanaryError, match="non-finite"):
        canary.check(aux * float("nan"), hs[-1], model_greedy)
    with pytest.raises(CanaryError, match="shapes"):
        canary.check(aux[:, :576], hs[-1], model_greedy)


def test_dumps_go_to_tmpfs_when_it_has_room(tmp_path):
    from aerie.extract.plan import dump_root

    cfg = ExtractConfig(batch_tokens=1024, requests_in_flight=2)
    work = tmp_path / "work"
    root = dump_root(cfg, "r", "k", work, hidden_size=576)
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        assert root == Path("/dev/shm/aerie-extract/r/k")
    else:
        assert root == work / "dumps"
    # Kimi-size dumps in flight do not fit any tmpfs here: they go to the work dir.
    huge = cfg.model_copy(update={"batch_tokens": 1 << 30})
    assert dump_root(huge, "r", "k", work, hidden_size=7168) == work / "dumps"
    explicit = cfg.model_copy(update={"dump_dir": str(tmp_path / "d")})
    assert dump_root(explicit, "r", "k", work, hidden_size=576) == tmp_path / "d" / "r" / "k"


# ---- quantization on the server (extract.quantize_on_server) --------------------------------------


def test_server_quantization_is_refused_where_it_cannot_apply():
    from aerie.config import apply_overrides
    from aerie.errors import ConfigError
    from aerie.extract.fleet import _server_args
    from aerie.extract.plan import check_server_quantization
    from aerie.presets import get_preset
    from aerie.serving import ServerConfig
    from aerie.targets import TargetGeometry, TargetInfo

    base = get_preset("smollm2-local")
    # At load: bf16 storage would make the shards carry fp8's rounding.
    with pytest.raises(ConfigError, match="needs extract.storage_dtype 'fp8', not 'bf16'"):
        apply_overrides(base, ["extract.storage_dtype=bf16", "extract.quantize_on_server=true"])
    # At load too, not after hours of generation: the SGLang dump plugin writes the model dtype.
    on = ["extract.storage_dtype=fp8", "extract.quantize_on_server=true"]
    with pytest.raises(ConfigError, match="needs server.backend 'reference', not 'sglang'"):
        apply_overrides(base, [*on, "server.backend=sglang"])
    assert apply_overrides(base, on).extract.quantize_on_server
    fp8 = ExtractConfig(storage_dtype="fp8", quantize_on_server=True)
    reference, sglang = ServerConfig(backend="reference"), ServerConfig(backend="sglang")
    check_server_quantization(fp8, reference)
    geometry = TargetGeometry.model_construct(num_layers=30)
    target = TargetInfo.model_construct(geometry=geometry)  # EAGLE-3's layers: no --aux-layers
    assert _server_args(reference, fp8, target) == ["--max-batch-tokens", "16384", "--dump-dtype", "fp8"]
    assert _server_args(reference, fp8.model_copy(update={"quantize_on_server": False}), target) == [
        "--max-batch-tokens",
        "16384",
    ]
    # In the stage: the SGLang plugin dumps the model dtype; a model_copy skips the config's validator.
    with pytest.raises(
        ConfigError, match="needs server.backend 'reference', not 'sglang'.*SGLang dump plugin"
    ):
        check_server_quantization(fp8, sglang)
    bf16 = fp8.model_copy(update={"storage_dtype": "bf16"})
    with pytest.raises(ConfigError, match="needs extract.storage_dtype 'fp8', not 'bf16'"):
        check_server_quantization(bf16, reference)
    check_server_quantization(ExtractConfig(), sglang)  # off: nothing to refuse


def test_canary_accepts_fp8_dumps_of_the_right_layers_and_still_names_a_wrong_one(smollm2, reference):
    ids, hs = reference
    row = Row(0, "c", ids, [1] * len(ids))
    canary = ExtractionCanary(smollm2, row, reference=True, rtol=0.02)
    canary._hidden = hs  # the module's reference forward, not a second one
    aux = torch.cat([hs[i] for i in smollm2.aux_layers_input], -1)
    greedy = int(
        (hs[-1][-1] @ smollm2.load_model("cpu", "float32").get_output_embeddings().weight.T).argmax()
    )
    (aux_q, aux_s), (last_q, last_s) = quantize_fp8(aux, 3), quantize_fp8(hs[-1], 1)
    deq = _dequantized(aux_q, aux_s, last_q, last_s)
    # fp8's rounding (~0.02 per token) is over this rtol alone: the fp8 allowance is what lets it pass.
    with pytest.raises(CanaryError, match="canary_rtol 0.02"):
        canary.check(*deq, greedy)
    result = canary.check(*deq, greedy, fp8=True)
    assert result.dtype == "float8_e4m3fn" and [b["best"] for b in result.numeric["blocks"]] == [2, 15, 27]
    assert 0.005 < result.numeric["last_rel_err"] < 0.05 and result.numeric["rtol"] == pytest.approx(0.05)
    shifted = torch.cat([hs[i + 1] for i in smollm2.aux_layers_input], -1)
    wrong = _dequantized(*quantize_fp8(shifted, 3), last_q, last_s)
    with pytest.raises(CanaryError, match=r"aux block 0 matches hidden_states\[3\], not \[2\]"):
        canary.check(*wrong, greedy, fp8=True)
