"""Hidden-state shards: exact bf16 round trip, fp8 within its rounding bound, packing, atomicity."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from aerie import tensorfile
from aerie.errors import DataError, ExtractionError
from aerie.fp8 import dequantize_fp8, pow2, quantize_fp8, scale_values
from aerie.shards.format import HiddenSample
from aerie.shards.reader import ShardReader
from aerie.shards.schema import bytes_per_token
from aerie.shards.writer import ShardWriter

H = 64


def make_sample(i: int, t: int, gen: torch.Generator) -> HiddenSample:
    # Residual-stream-like values: per-layer magnitudes growing with depth and a few outlier tokens
    # (attention sinks) that are 50x larger than the rest.
    layer_scale = torch.tensor([1.0, 8.0, 40.0]).repeat_interleave(H)
    aux = torch.randn(t, 3 * H, generator=gen) * layer_scale
    aux[0] *= 50.0
    last = torch.randn(t, H, generator=gen) * 3.0
    return HiddenSample(
        id=f"s{i}",
        input_ids=torch.randint(0, 49152, (t,), generator=gen),
        loss_mask=torch.rand(t, generator=gen) > 0.4,
        aux_hidden=aux.to(torch.bfloat16),
        last_hidden=last.to(torch.bfloat16),
    )


def write_all(tmp_path, samples, storage, shard_bytes=1 << 30, direct_io=False, vocab_size=None):
    w = ShardWriter(
        tmp_path,
        storage=storage,
        shard_bytes=shard_bytes,
        hidden_size=H,
        direct_io=direct_io,
        vocab_size=vocab_size,
    )
    infos = [info for s in samples if (info := w.add(s))]
    if (last := w.close()) is not None:
        infos.append(last)
    return infos


@pytest.fixture
def samples():
    gen = torch.Generator().manual_seed(0)
    return [make_sample(i, t, gen) for i, t in enumerate([7, 33, 1, 120, 64, 5])]


def test_bf16_round_trip_is_exact(tmp_path, samples):
    (info,) = write_all(tmp_path, samples, "bf16")
    assert info.samples == len(samples) and info.tokens == sum(s.tokens for s in samples)
    assert info.bytes == info.path.stat().st_size
    assert info.sha256 == hashlib.sha256(info.path.read_bytes()).hexdigest()
    r = ShardReader(info.path)
    assert len(r) == len(samples) and r.sample_ids == [s.id for s in samples] and r.tokens == info.tokens
    for want, got in zip(samples, r, strict=True):
        assert got.id == want.id
        assert got.input_ids.dtype == torch.int64 and torch.equal(got.input_ids, want.input_ids)
        assert got.loss_mask.dtype == torch.bool and torch.equal(got.loss_mask, want.loss_mask)
        assert torch.equal(got.aux_hidden, want.aux_hidden)
        assert torch.equal(got.last_hidden, want.last_hidden)
    # A contiguous slice across sample boundaries is the concatenation of the samples' tokens.
    part = r.token_slice(3, 50)
    cat = torch.cat([s.aux_hidden for s in samples])
    assert torch.equal(part["aux_hidden"], cat[3:50])
    assert torch.equal(part["input_ids"], torch.cat([s.input_ids for s in samples])[3:50])


@pytest.mark.parametrize(("vocab_size", "ids_dtype"), [(49152, torch.uint16), (None, torch.int32)])
def test_file_is_plain_safetensors_with_metadata(tmp_path, samples, vocab_size, ids_dtype):
    (info,) = write_all(tmp_path, samples, "fp8", vocab_size=vocab_size)
    with safe_open(str(info.path), framework="pt") as f:
        meta = f.metadata()
        assert set(f.keys()) == {
            "input_ids",
            "loss_mask",
            "offsets",
            "aux_hidden",
            "last_hidden",
            "aux_scale",
            "last_scale",
        }
        n = info.tokens
        assert f.get_tensor("input_ids").dtype == ids_dtype
        assert f.get_tensor("loss_mask").dtype == torch.uint8
        assert f.get_tensor("aux_hidden").dtype == torch.float8_e4m3fn
        assert f.get_tensor("aux_scale").dtype == f.get_tensor("last_scale").dtype == torch.uint8
        assert tuple(f.get_tensor("aux_hidden").shape) == (n, 3 * H)
        assert tuple(f.get_tensor("aux_scale").shape) == (n, 3)
        assert tuple(f.get_tensor("last_scale").shape) == (n, 1)
        assert f.get_tensor("offsets").tolist() == [0, 7, 40, 41, 161, 225, 230]
    assert meta["storage"] == "fp8" and meta["hidden_size"] == str(H) and meta["schema_version"] == "2"
    assert json.loads(meta["sample_ids"]) == [s.id for s in samples]
    # The data section is exactly what bytes_per_token counts, plus the offsets.
    header = 8 + int.from_bytes(info.path.read_bytes()[:8], "little")
    assert info.bytes - header == n * bytes_per_token("fp8", H, vocab_size) + 8 * (len(samples) + 1)


def fp8_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest error e4m3 rounding may make. Normals (|x/scale| >= 2^-6) keep 3 mantissa bits, so
    round-to-nearest is off by at most half a spacing = 2^-4 of the value itself; subnormals have a
    fixed spacing of 2^-9 (in units of the scale), so at most 2^-10 * scale. Float32 arithmetic adds
    ~2^-23 relative, covered by the 1e-6 term."""
    return 2.0**-4 * x.abs() + 2.0**-10 * scale + 1e-6 * x.abs()


def test_fp8_round_trip_within_rounding_bound(tmp_path, samples):
    (info,) = write_all(tmp_path, samples, "fp8")
    r = ShardReader(info.path, dtype=torch.float32)
    raw = r.token_slice(0, r.tokens, dequantize=False)
    for want, got, start in zip(samples, r, r.offsets[:-1].tolist(), strict=True):
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.loss_mask, want.loss_mask)
        t = want.tokens
        x = want.aux_hidden.float().reshape(t, 3, H)
        scale = scale_values(raw["aux_scale"][start : start + t]).reshape(t, 3, 1)
        err = (got.aux_hidden.reshape(t, 3, H) - x).abs()
        assert bool((err <= fp8_bound(x, scale)).all())
        # Per token and layer, the worst error is at most 2^-4 of that token's (layer's) max.
        assert bool((err.amax(-1) <= 2.0**-4 * x.abs().amax(-1) + 1e-6).all())
        y = want.last_hidden.float()
        err_last = (got.last_hidden - y).abs()
        assert bool((err_last <= fp8_bound(y, scale_values(raw["last_scale"][start : start + t]))).all())
    # Per-layer scales matter: the small first layer keeps its precision next to the large third one.
    aux_scale = scale_values(raw["aux_scale"])
    assert bool((aux_scale[:, 2] > 10 * aux_scale[:, 0]).all())


def test_fp8_is_half_the_bytes_of_bf16(tmp_path, samples):
    (bf16,) = write_all(tmp_path / "bf16", samples, "bf16")
    (fp8,) = write_all(tmp_path / "fp8", samples, "fp8")
    tokens = bf16.tokens
    # Per token: fp8 stores 4H bytes + 4 bytes of scales + 5 of ids/mask, bf16 8H + 5.
    overhead = 4 * tokens + 5 * tokens + 2048  # scales, ids/mask, header
    assert fp8.bytes <= 0.5 * bf16.bytes + overhead


@pytest.mark.parametrize(
    ("hidden", "vocab", "vs_own", "vs_peers"),
    [(576, 49152, 0.50119, 0.49978), (7168, 163840, 0.50011, 0.50002)],  # SmolLM2-135M, Kimi-K2.5
)
def test_fp8_bytes_per_token_against_bf16_layouts(hidden, vocab, vs_own, vs_peers):
    """fp8 against aerie's own bf16 shards and against the bf16 that SpecForge stores (int64 ids and
    int64 loss mask beside the states: 16 bytes a token)."""
    fp8 = bytes_per_token("fp8", hidden, vocab)
    assert fp8 == 4 * hidden + 4 + (2 if vocab <= 65536 else 4) + 1
    assert round(fp8 / bytes_per_token("bf16", hidden, vocab), 5) == vs_own
    assert round(fp8 / (8 * hidden + 16), 5) == vs_peers


def test_quantize_handles_zero_rows_and_groups():
    x = torch.zeros(2, 6)
    x[1, 3:] = torch.tensor([1.0, -896.0, 2.0])
    q, s = quantize_fp8(x, groups=2)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8 and s.shape == (2, 2)
    assert q[0].float().abs().sum() == 0  # an all-zero group: zero codes, whatever its scale
    assert scale_values(s)[1, 1] == 2.0  # 896 = 448 * 2: 0.5, -448 and 1 are exact in e4m3
    assert torch.equal(dequantize_fp8(q, s, torch.float32), x)
    with pytest.raises(ValueError):
        quantize_fp8(x, groups=4)


def _smallest_pow2_scale(amax: float) -> int:
    """The reference: the smallest e with amax <= 448 * 2**e, in exact float64 arithmetic."""
    e = -126
    while amax > 448.0 * 2.0**e:
        e += 1
    return e


def test_scales_are_the_smallest_power_of_two_that_fits():
    """The contract a device quantization must meet too (tests/test_extraction_cuda.py checks the CUDA
    path on a GPU): scale = 2**e, the smallest with amax / 2**e <= 448, so the codes use e4m3's whole
    range and never round past 448; boundaries (amax exactly 448 * 2**j, and the next float up)
    included."""
    gen = torch.Generator().manual_seed(3)
    amax = torch.cat(
        [
            torch.rand(4096, generator=gen) * 50 + 1e-3,
            torch.tensor([448.0, 224.0, 896.0, 448.0 * 2.0**-20, 1e-30, 3e38]),
            torch.nextafter(torch.tensor([448.0, 224.0, 896.0]), torch.tensor(1e9)),
        ]
    )
    x = torch.zeros(len(amax), 8)
    x[:, 0] = amax
    x[:, 1] = -amax / 3
    q, scale = quantize_fp8(x, groups=1)
    want = torch.tensor([_smallest_pow2_scale(a) for a in amax.tolist()])
    assert torch.equal(scale[:, 0].long() - 127, want)
    assert float(q.float().abs().amax()) <= 448.0 and bool(q.float().isfinite().all())
    codes = q.float()[:, 0]
    assert bool(((codes >= 224) & (codes <= 448)).all())  # (224, 448] before rounding: the top binade
    assert torch.equal(
        pow2(torch.tensor([-126, -1, 0, 7, 126])), torch.tensor([2.0**-126, 0.5, 1.0, 128.0, 2.0**126])
    )


def test_quantize_a_group_far_below_any_activation():
    """A ~1e-38 group (a bf16 denormal's neighbourhood) is scaled by the largest power of two there is
    (2**126) rather than its ideal one, and still quantizes within the rounding bound; the ordinary
    group beside it gets the codes it gets alone."""
    x = torch.tensor([[1e-38, -5e-39, 0.0, 2e-39, 1.0, -2.0, 0.5, 3.0]]).bfloat16()
    q, s = quantize_fp8(x, groups=2)
    assert s[0, 0] == 127 - 126
    back = dequantize_fp8(q, s, torch.float32)
    want = x.float()
    assert bool((back - want).abs().le(fp8_bound(want, scale_values(s).repeat_interleave(4, dim=1))).all())
    alone, _ = quantize_fp8(x[:, 4:], groups=1)  # the ordinary group's codes are what they are alone
    assert torch.equal(q[:, 4:].view(torch.uint8), alone.view(torch.uint8))


def test_schema_1_shards_with_float32_scales_are_still_read(tmp_path, samples):
    """A shard written before the E8M0 scales (schema version 1: float32 scales, int32 ids) reads back
    as it did: the same file with its scales widened to float32 and its version set to 1."""
    (info,) = write_all(tmp_path / "v2", samples, "fp8")
    with safe_open(str(info.path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
        meta = dict(f.metadata(), schema_version="1")
    for k in ("aux_scale", "last_scale"):
        tensors[k] = scale_values(tensors[k])
    old = tmp_path / "v1.safetensors"
    save_file(tensors, str(old), metadata=meta)
    new_r, old_r = ShardReader(info.path, dtype=torch.float32), ShardReader(old, dtype=torch.float32)
    for a, b in zip(new_r, old_r, strict=True):
        assert torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.last_hidden, b.last_hidden)
        assert torch.equal(a.input_ids, b.input_ids)


def test_ids_outside_the_vocabulary_are_refused_not_wrapped(tmp_path):
    gen = torch.Generator().manual_seed(2)
    sample = make_sample(0, 9, gen)
    sample.input_ids[4] = 70000
    w = ShardWriter(tmp_path, storage="bf16", shard_bytes=1 << 20, hidden_size=H, vocab_size=49152)
    w.add(sample)
    with pytest.raises(ExtractionError, match=r"token ids outside \[0, 65536\).*70000"):
        w.close()
    assert not list(tmp_path.iterdir())  # nothing half-written is left


def test_shards_split_by_size_without_splitting_samples(tmp_path):
    gen = torch.Generator().manual_seed(1)
    samples = [make_sample(i, 50, gen) for i in range(10)]
    per_sample = 50 * bytes_per_token("bf16", H) + 8
    w = ShardWriter(tmp_path, storage="bf16", shard_bytes=3 * per_sample + 8, hidden_size=H, prefix="x")
    closed = [(i, info) for i, s in enumerate(samples) if (info := w.add(s))]
    # A shard closes when the next sample would not fit: after samples 0-2, 3-5, 6-8.
    assert [i for i, _ in closed] == [3, 6, 9]
    last = w.close()
    assert last is not None and last.samples == 1 and w.close() is None
    infos = [info for _, info in closed] + [last]
    assert [i.name for i in infos] == [f"x-{n:05d}.safetensors" for n in range(4)]
    assert sum(i.samples for i in infos) == 10
    assert [sid for i in infos for sid in ShardReader(i.path).sample_ids] == [s.id for s in samples]
    # No temp files are left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == [i.name for i in infos]


@pytest.mark.parametrize("how", ["short writes", "no writev"])
def test_a_shard_is_the_same_bytes_however_the_os_takes_the_writes(tmp_path, samples, monkeypatch, how):
    """Shards are written with writev, many buffers a call. A call that writes only part of what it
    was given (the kernel may stop anywhere: a signal, its 2 GB cap) must carry on from the first byte
    not written, and an OS without writev writes part by part: the same file either way."""
    (want,) = write_all(tmp_path / "plain", samples, "fp8")
    calls = []
    if how == "short writes":
        real = os.writev

        def short(fd: int, buffers: list) -> int:
            # At most 1,000 bytes a call, cut anywhere: inside a buffer, or mid-way through the list.
            out, budget = [], 1000
            for b in buffers:
                if budget <= 0:
                    break
                out.append(memoryview(b)[:budget])
                budget -= out[-1].nbytes
            calls.append(len(buffers))
            return real(fd, out)

        monkeypatch.setattr(os, "writev", short)
    else:
        monkeypatch.delattr(os, "writev")
    (got,) = write_all(tmp_path / how.replace(" ", "-"), samples, "fp8")
    assert got.path.read_bytes() == want.path.read_bytes() and got.sha256 == want.sha256
    if how == "short writes":
        assert len(calls) >= want.bytes // 1000  # it really went through the short-write path


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_shards_written_with_o_direct_are_the_same_files(tmp_path, samples, monkeypatch, storage):
    """`direct_io` (`extract.direct_io`) writes through 8 KiB bounce buffers here, so every shard
    crosses several: the same files, digests and sizes as through the page cache."""
    monkeypatch.setattr(tensorfile, "DIRECT_CHUNK", 8192)
    want = write_all(tmp_path / "buffered", samples, storage, shard_bytes=1 << 14)
    got = write_all(tmp_path / "direct", samples, storage, shard_bytes=1 << 14, direct_io=True)
    assert len(got) == len(want) > 1
    for g, w in zip(got, want, strict=True):
        assert (g.name, g.bytes, g.sha256) == (w.name, w.bytes, w.sha256)
        assert g.path.read_bytes() == w.path.read_bytes()
    assert sorted(p.name for p in (tmp_path / "direct").iterdir()) == [g.name for g in got]


def test_bad_samples_and_files_are_refused(tmp_path, samples):
    w = ShardWriter(tmp_path, storage="bf16", shard_bytes=1 << 20, hidden_size=H)
    bad = samples[0]
    bad.last_hidden = bad.last_hidden[:, :10]
    with pytest.raises(ExtractionError, match="last_hidden has shape"):
        w.add(bad)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a shard")
    with pytest.raises(DataError, match="cannot open shard"):
        ShardReader(junk)


def test_samples_quantized_upstream_give_the_same_shards_and_need_fp8_storage(tmp_path, samples):
    """A server dumping fp8 (`--dump-dtype fp8`) quantizes whole packs; the writer stores its codes and
    scales as they are, and the shards are the ones it writes when it quantizes each sample itself."""
    pack_aux = torch.cat([s.aux_hidden for s in samples])
    pack_last = torch.cat([s.last_hidden for s in samples])
    (aux_q, aux_s), (last_q, last_s) = quantize_fp8(pack_aux, 3), quantize_fp8(pack_last, 1)
    quantized, at = [], 0
    for s in samples:
        rows = slice(at, at + s.tokens)
        at += s.tokens
        quantized.append(
            HiddenSample(s.id, s.input_ids, s.loss_mask, aux_q[rows], last_q[rows], aux_s[rows], last_s[rows])
        )
    here = write_all(tmp_path / "client", samples, "fp8", shard_bytes=1 << 14)
    upstream = write_all(tmp_path / "server", quantized, "fp8", shard_bytes=1 << 14)
    assert len(here) > 1 and [i.sha256 for i in upstream] == [i.sha256 for i in here]
    w = ShardWriter(tmp_path / "bf16", storage="bf16", shard_bytes=1 << 20, hidden_size=H)
    with pytest.raises(ExtractionError, match="arrives quantized to fp8 but this writer stores bf16"):
        w.add(quantized[0])
    fp8 = ShardWriter(tmp_path / "bad", storage="fp8", shard_bytes=1 << 20, hidden_size=H)
    bad = quantized[1]
    with pytest.raises(ExtractionError, match=r"aux_scale has shape \(33, 1\), expected \(33, 3\)"):
        fp8.add(
            HiddenSample(
                bad.id,
                bad.input_ids,
                bad.loss_mask,
                bad.aux_hidden,
                bad.last_hidden,
                bad.last_scale,
                bad.last_scale,
            )
        )
