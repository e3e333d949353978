"""Streamed safetensors writes and memory-mapped reads (`aerie.tensorfile`), checked against the
safetensors library itself: what one writes the other reads, byte for byte."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aerie import tensorfile
from aerie.errors import ExtractionError
from aerie.extract.client import read_dumps
from aerie.tensorfile import (
    TensorParts,
    layout,
    load_mapped,
    open_direct,
    whole,
    write_all,
    write_direct,
)


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "offsets": torch.tensor([0, 3, 5], dtype=torch.int64),
        "aux_hidden": torch.randn(5, 6).to(torch.float8_e4m3fn),
        "aux_scale": torch.rand(5, 3),
        "input_ids": torch.arange(5, dtype=torch.int32),
        "last_hidden": torch.randn(5, 2).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
    }


def _write(path: Path, tensors: list[TensorParts], metadata: dict[str, str]) -> None:
    parts, size = layout(tensors, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        write_all(fd, parts)
    finally:
        os.close(fd)
    assert path.stat().st_size == size


def test_a_streamed_file_is_what_safetensors_reads(tmp_path: Path) -> None:
    want = _tensors()
    # aux_hidden in two chunks along tokens, as a shard streams its samples.
    parts = [
        TensorParts(n, t.dtype, list(t.shape), [t[:2], t[2:]] if n == "aux_hidden" else [t])
        for n, t in want.items()
    ]
    _write(tmp_path / "a.safetensors", parts, {"k": "v"})
    got = load_file(tmp_path / "a.safetensors")
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name].view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("how", ["mapped", "read (a small file)"])
def test_a_mapped_read_equals_safetensors_and_outlives_the_file(tmp_path: Path, how: str) -> None:
    want = _tensors()
    path = tmp_path / "b.safetensors"
    save_file(want, str(path), metadata={"rid": "r1"})
    got, metadata = load_mapped(path, min_mapped_bytes=0 if how == "mapped" else 1 << 20)
    path.unlink()  # the mapping keeps the bytes, as a client that deletes each dump once read needs
    assert metadata == {"rid": "r1"}
    for name, t in want.items():
        assert got[name].shape == t.shape and torch.equal(got[name].view(torch.uint8), t.view(torch.uint8))
    got["aux_scale"][0, 0] = 7.0  # private mapping: writable, and nothing else sees it


@pytest.mark.parametrize(
    "damage",
    ["empty file", "header longer than the file", "not json", "data cut short", "unknown dtype"],
)
def test_a_malformed_file_is_a_value_error(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "c.safetensors"
    save_file({"x": torch.arange(16, dtype=torch.int32)}, str(path))
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    bad = {
        "empty file": b"",
        "header longer than the file": (10**6).to_bytes(8, "little") + data[8:],
        "not json": data[:8] + b"{" * n + data[8 + n :],
        "data cut short": data[:-4],
        "unknown dtype": data.replace(b'"I32"', b'"Q32"'),
    }[damage]
    path.write_bytes(bad)
    with pytest.raises(ValueError):
        load_mapped(path)


def test_the_client_names_a_dump_it_cannot_read_and_keeps_it(tmp_path: Path) -> None:
    """A torn or foreign file in the dump dir fails the batch with the file's name; the file stays
    for a look (a good dump is deleted once read)."""
    good, bad = tmp_path / "r1.safetensors", tmp_path / "r2.safetensors"
    _write(
        good,
        whole(
            {
                "input_ids": torch.arange(3, dtype=torch.int32),
                "aux_hidden": torch.zeros(3, 6),
                "last_hidden": torch.zeros(3, 2),
            }
        ),
        {},
    )
    bad.write_bytes(b"\x08" + b"\x00" * 7 + b"garbage!")
    with pytest.raises(ExtractionError, match="unreadable dump .*r2.safetensors"):
        read_dumps([good, bad])
    assert not good.exists() and bad.exists()


def test_a_server_dump_maps_with_every_tensor_aligned(tmp_path: Path) -> None:
    """The reference server's fp8 dump (int32 ids, fp8 codes, E8M0 scale bytes) as the client maps it:
    the same values, each tensor starting at a multiple of its element size."""
    from aerie.engine.server.dump import write_dump
    from aerie.engine.server.extraction import Capture

    t, h = 5, 6
    cap = Capture(
        input_ids=torch.arange(t, dtype=torch.int32),
        aux_hidden=torch.randn(t, 3 * h).to(torch.float8_e4m3fn),
        last_hidden=torch.randn(t, h).to(torch.float8_e4m3fn),
        aux_scale=torch.randint(100, 140, (t, 3), dtype=torch.uint8),
        last_scale=torch.randint(100, 140, (t, 1), dtype=torch.uint8),
    )
    write_dump(tmp_path, "r1", cap, {"rid": "r1"})
    got, metadata = load_mapped(tmp_path / "r1.safetensors")
    assert metadata == {"rid": "r1"}
    for name in ("input_ids", "aux_hidden", "last_hidden", "aux_scale", "last_scale"):
        want = getattr(cap, name)
        assert torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), name
        assert got[name].data_ptr() % got[name].element_size() == 0, name


def _direct_file(path: Path, parts: list[memoryview]) -> bool:
    """Write `parts` as the shard writer does with `direct_io`; False where the filesystem refuses
    O_DIRECT at open."""
    fd, direct = open_direct(path)
    try:
        if direct:
            write_direct(fd, parts)
    finally:
        os.close(fd)
    return direct


@pytest.mark.parametrize("rows", [0, 1, 255, 256, 257, 1000])
def test_a_direct_write_is_the_buffered_file_byte_for_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: int
) -> None:
    """O_DIRECT writes go through aligned bounce buffers of DIRECT_CHUNK bytes (8 KiB here, so a few
    KB of tensors cross many of them): files ending inside a buffer, on its end and just after it are
    the same bytes as `write_all`'s, truncated to the same size."""
    monkeypatch.setattr(tensorfile, "DIRECT_CHUNK", 8192)
    aux = torch.randn(rows, 6).to(torch.bfloat16)  # 12 bytes a row: chunks split rows anywhere
    tensors = [
        TensorParts("aux_hidden", aux.dtype, list(aux.shape), [aux[: rows // 3], aux[rows // 3 :]]),
        *whole({"input_ids": torch.arange(rows, dtype=torch.int32)}),
    ]
    parts, size = layout(tensors, {"rows": str(rows)})
    _write(tmp_path / "buffered.safetensors", tensors, {"rows": str(rows)})
    if not _direct_file(tmp_path / "direct.safetensors", parts):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    got = (tmp_path / "direct.safetensors").read_bytes()
    assert len(got) == size and got == (tmp_path / "buffered.safetensors").read_bytes()


def test_a_filesystem_refusing_direct_writes_gets_a_buffered_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some filesystems take O_DIRECT at open and refuse the writes (EINVAL). No such filesystem can
    be mounted here without root, so os.pwrite is made to refuse: the file must still be whole, written
    through the page cache once the flag is cleared."""
    tensors = whole({"aux_hidden": torch.randn(3000, 6).to(torch.bfloat16)})
    parts, size = layout(tensors, {})
    _write(tmp_path / "want.safetensors", tensors, {})

    def refuse(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "pwrite", refuse)
    if not _direct_file(tmp_path / "got.safetensors", parts):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT at open")
    got = (tmp_path / "got.safetensors").read_bytes()
    assert len(got) == size and got == (tmp_path / "want.safetensors").read_bytes()
