"""The reference server's CUDA-only capture paths, checked against the paths CPU CI does run: the
overlapped device->host copy (pinned memory, side stream) against the synchronous copy, and fp8
quantization on the device against the same function on the CPU. Both skip without a GPU; on the GPU
host they take seconds, so they can run before trusting an extraction to them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from aerie.engine.server.args import default_aux_layers
from aerie.engine.server.extraction import SYNC_COPY_ENV, HiddenStateCapture
from aerie.fp8 import quantize_fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA capture paths need a GPU"),
]


@pytest.fixture(scope="module")
def gpu_model(smollm2: Any) -> Any:
    from aerie.engine.server import packed
    from aerie.engine.server.loader import load_model

    packed.register()
    return load_model(smollm2.path, "cuda", "bfloat16", skip_tokenizer=False)


def _sequences() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (700, 37, 1500, 256)]


def _capture(loaded: Any, monkeypatch: pytest.MonkeyPatch, *, sync: bool, dump_dtype: str = "model") -> Any:
    with monkeypatch.context() as env:
        env.setenv(SYNC_COPY_ENV, "1" if sync else "0")
        capture = HiddenStateCapture(
            loaded.model,
            default_aux_layers(loaded.num_layers),
            loaded.device,
            dump_dtype,  # type: ignore[arg-type]
        )
    capture.choose_attention()
    return capture


def test_the_overlapped_copy_gives_the_synchronous_copys_tensors(gpu_model, monkeypatch) -> None:
    sync = _capture(gpu_model, monkeypatch, sync=True)
    overlapped = _capture(gpu_model, monkeypatch, sync=False)
    assert sync._copy_stream is None and overlapped._copy_stream is not None
    with torch.inference_mode():  # as the server's model thread runs them
        want = sync.capture(_sequences())
        # Several packs in flight before any is waited for: the copies must not race the next forwards.
        packs = [overlapped.start(_sequences()) for _ in range(3)]
    for pack in packs:
        pack.wait()
        assert pack.forward_s > 0 and pack.copy_s > 0
        for a, b in zip(pack.captures, want, strict=True):
            assert torch.equal(a.input_ids, b.input_ids)
            assert torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.last_hidden, b.last_hidden)


def test_fp8_on_the_device_gives_the_cpu_quantizations_bits(gpu_model, monkeypatch) -> None:
    groups = len(default_aux_layers(gpu_model.num_layers))
    with torch.inference_mode():
        model_dtype = _capture(gpu_model, monkeypatch, sync=True).capture(_sequences())
    for sync in (True, False):
        with torch.inference_mode():
            fp8 = _capture(gpu_model, monkeypatch, sync=sync, dump_dtype="fp8").capture(_sequences())
        for q, ref in zip(fp8, model_dtype, strict=True):
            aux_q, aux_s = quantize_fp8(ref.aux_hidden, groups)
            last_q, last_s = quantize_fp8(ref.last_hidden, 1)
            assert torch.equal(q.aux_hidden.view(torch.uint8), aux_q.view(torch.uint8))
            assert torch.equal(q.last_hidden.view(torch.uint8), last_q.view(torch.uint8))
            assert q.aux_scale is not None and q.last_scale is not None
            assert torch.equal(q.aux_scale, aux_s) and torch.equal(q.last_scale, last_s)
