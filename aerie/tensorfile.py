"""safetensors files written by streaming tensor bytes, and read by mapping them: no copy in memory.

`safetensors.torch.save_file` copies every tensor into a Python `bytes` object (holding the GIL for the
copy), then serializes those copies into the file. On an extraction server that copy is made on the
dump writer threads while the model thread needs the GIL to launch the next forward's kernels. Here the
file is the safetensors layout (u64 header length, JSON header padded to 8 bytes, then each tensor's
bytes in order) written straight from the tensors' memory with writev, which releases the GIL while
the kernel copies. The files are ordinary safetensors files (`safe_open` and `load_file` read them);
`load_mapped` reads one without copying its data.

`write_direct` writes such a file with O_DIRECT instead, where the filesystem takes it: on an H200
host's disk, 1 GiB files went out at 1.83 GB/s that way against 1.15 GB/s through the page cache and
fsync (`benchmarks/results/disk_write-h200.json`, the methods interleaved). The extraction benchmark
measures the disk with it; shards use it only with `extract.direct_io` (see there why not by default).
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import mmap
import os
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

# safetensors dtype names of the torch dtypes aerie writes.
ST_DTYPE = {
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float8_e4m3fn: "F8_E4M3",
}
IOV_MAX = 1024  # the Linux and macOS limit on buffers per writev


@dataclass(frozen=True)
class TensorParts:
    """One tensor of a file, given as chunks concatenated along the first dimension (a shard's
    samples), so they are written one after another without a `torch.cat`."""

    name: str
    dtype: torch.dtype
    shape: list[int]
    chunks: Sequence[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.chunks)


def raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes (little-endian, C order) without a copy when it is already contiguous."""
    # Only the calls it needs: each torch call releases the GIL and must win it back (dump writers and
    # shard writers call this per tensor, beside threads that launch kernels or read dumps).
    if t.requires_grad:
        t = t.detach()
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]


def layout(tensors: Sequence[TensorParts], metadata: dict[str, str]) -> tuple[list[memoryview], int]:
    """The file as buffers in order (the header first, then every chunk) and its size in bytes."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        nbytes = t.nbytes
        header[t.name] = {
            "dtype": ST_DTYPE[t.dtype],
            "shape": t.shape,
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-aligned, as safetensors writes it
    parts = [memoryview(struct.pack("<Q", len(blob)) + blob)]
    parts += [raw(c) for t in tensors for c in t.chunks]
    return parts, 8 + len(blob) + offset


def whole(tensors: dict[str, torch.Tensor]) -> list[TensorParts]:
    """`TensorParts` of whole tensors, in the given order."""
    return [TensorParts(name, t.dtype, list(t.shape), [t]) for name, t in tensors.items()]


def write_all(fd: int, parts: list[memoryview]) -> None:
    """Write `parts` to `fd` in order, up to `IOV_MAX` per system call (writev) where the OS has it.

    A shard is ~1,000 parts (two per sample). Written one by one, each call releases the GIL and must
    win it back from the extraction's other threads: a thousand such waits a shard instead of one. A
    short write (a signal, the 2 GB per-call cap) carries on from the first byte not written; without
    writev, one part a call."""
    writev = getattr(os, "writev", None) or (lambda fd, buffers: os.write(fd, buffers[0]))
    pending, i = list(parts), 0
    while i < len(pending):
        n = writev(fd, pending[i : i + IOV_MAX])
        if n <= 0:
            raise OSError(f"writev wrote nothing of {sum(p.nbytes for p in pending[i:])} bytes")
        while i < len(pending) and n >= pending[i].nbytes:
            n -= pending[i].nbytes
            i += 1
        if n:
            pending[i] = pending[i][n:]


# O_DIRECT wants buffer addresses, file offsets and lengths aligned to the device's logical block size;
# 4,096 covers both 512-byte and 4K devices.
DIRECT_ALIGN = 4096
DIRECT_CHUNK = 32 << 20  # bytes per O_DIRECT write: large enough that the device streams


def open_direct(path: str | os.PathLike[str], mode: int = 0o644) -> tuple[int, bool]:
    """`path` created or truncated for writing, and whether it is open with O_DIRECT: tmpfs and some
    other filesystems refuse the flag (EINVAL), and then the file is opened for ordinary writes."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, mode), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False


def write_direct(fd: int, parts: list[memoryview]) -> None:
    """Write `parts` in order from offset 0 of `fd`, a new file opened by `open_direct` with O_DIRECT.

    O_DIRECT moves the bytes from aligned memory straight to the device, so the parts (tensors at any
    address) go through two aligned bounce buffers of DIRECT_CHUNK bytes: one is filled while the other
    is written (pwrite) on a second thread. Each buffer is filled by one `torch.cat`, which releases
    the GIL for the whole copy: a copy per part (a shard has ~1,400) would have to win the GIL back
    once per part from an extraction client's other threads. The last write is padded to the
    alignment and the file truncated to its size. The bytes still need an fsync to be durable (the
    device's write cache). A filesystem that took the flag at open but refuses the writes (EINVAL)
    gets the file through `write_all`."""
    bounce, buffers = _bounce_buffers()
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aerie-direct-write")
    pending: list[Future[None] | None] = [None, None]
    try:
        offset = filled = which = 0
        batch: list[torch.Tensor] = []

        def send() -> None:
            nonlocal offset, filled, which
            torch.cat(batch, out=buffers[which][:filled])
            padded = -(-filled // DIRECT_ALIGN) * DIRECT_ALIGN
            buffers[which][filled:padded] = 0
            pending[which] = writer.submit(_pwrite_all, fd, bounce[which], padded, offset)
            offset, filled, which = offset + padded, 0, 1 - which
            batch.clear()

        for src in (_as_bytes(p) for p in parts if p.nbytes):
            pos = 0
            while pos < src.numel():
                if not batch and (fut := pending[which]) is not None:
                    fut.result()  # the buffer is written: free again
                n = min(src.numel() - pos, DIRECT_CHUNK - filled)
                batch.append(src[pos : pos + n])
                filled, pos = filled + n, pos + n
                if filled == DIRECT_CHUNK:
                    send()
        if batch:
            send()
        for fut in pending:
            if fut is not None:
                fut.result()
        os.ftruncate(fd, sum(p.nbytes for p in parts))
    except OSError as exc:
        if exc.errno != errno.EINVAL or not _refused_direct(fd):
            raise
        writer.shutdown(wait=True)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        write_all(fd, parts)
    finally:
        writer.shutdown(wait=True)


def _as_bytes(part: memoryview) -> torch.Tensor:
    """The part's bytes as a uint8 tensor, without a copy unless the buffer is read-only (the small
    header): torch would warn that a tensor over it could write to it."""
    return torch.frombuffer(part if not part.readonly else bytearray(part), dtype=torch.uint8)


_THREAD = threading.local()


def _bounce_buffers() -> tuple[list[mmap.mmap], list[torch.Tensor]]:
    """This thread's two bounce buffers (anonymous mappings, so page-aligned), kept for its next file:
    mapping and faulting in 64 MiB afresh cost more than writing a small file."""
    if getattr(_THREAD, "size", 0) != DIRECT_CHUNK:
        _THREAD.size = DIRECT_CHUNK
        _THREAD.bounce = [mmap.mmap(-1, DIRECT_CHUNK) for _ in range(2)]
        _THREAD.buffers = [torch.frombuffer(b, dtype=torch.uint8) for b in _THREAD.bounce]
    return _THREAD.bounce, _THREAD.buffers


def _pwrite_all(fd: int, buf: mmap.mmap, length: int, offset: int) -> None:
    view = memoryview(buf)[:length]
    done = 0
    try:
        while done < length:
            n = os.pwrite(fd, view[done:], offset + done)
            if n <= 0:
                raise OSError(f"pwrite wrote nothing of {length - done} bytes")
            done += n
    finally:
        view.release()


def _refused_direct(fd: int) -> bool:
    """After an EINVAL from an O_DIRECT write: clear the flag, so the caller can write the file
    buffered; False if the fd was not in O_DIRECT mode (the EINVAL means something else)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    direct = getattr(os, "O_DIRECT", 0)
    if not direct or not flags & direct:
        return False
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~direct)
    return True


_TORCH_DTYPE = {name: dtype for dtype, name in ST_DTYPE.items()} | {"BOOL": torch.bool}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


MIN_MAPPED_BYTES = 1 << 20


def _tensor_at(buffer: Any, dtype: torch.dtype, shape: list[int], start: int, count: int) -> torch.Tensor:
    """The tensor over `count` bytes of `buffer` from `start`, in as few torch calls as it takes: a
    client calls this for every tensor of every dump, and each call that releases the GIL must win it
    back from the client's other threads."""
    if not count:
        return torch.empty(shape, dtype=dtype)
    if start % dtype.itemsize:  # not aligned for its type: view the bytes, then reinterpret
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=count, offset=start).view(dtype)
    else:
        flat = torch.frombuffer(buffer, dtype=dtype, count=count // dtype.itemsize, offset=start)
    return flat if len(shape) == 1 else flat.view(shape)


def load_mapped(
    path: str | os.PathLike[str], *, min_mapped_bytes: int = MIN_MAPPED_BYTES
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file's tensors and metadata, memory-mapped instead of read: no copy of the data.

    The mapping is private (copy-on-write), so the tensors are writable without touching the file, and
    it lives as long as any of the tensors does, also after the file is unlinked. An extraction client
    reads every dump once and hands its bytes on to a shard write, so `load_file`'s copy of each dump
    (tmpfs to process memory) was a third pass over every byte.

    A file smaller than `min_mapped_bytes` is read instead (one copy, cheap at that size): each mapping
    is one of the process's memory areas, of which Linux allows 65,530 by default, and a client holds
    every sample of the shards it is filling and writing. At 1 MiB a server's ~3.5 GB of such samples
    (three 1 GiB shards and the buffers) is at most ~3,500 mappings.

    `ValueError` when the file is not a well-formed safetensors file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{size} bytes: too short for a safetensors header")
        mapped: mmap.mmap | bytearray
        if size >= min_mapped_bytes:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        else:
            mapped = bytearray(size)
            if f.readinto(mapped) != size:
                raise ValueError(f"{path} changed size while it was read")
    (n,) = struct.unpack("<Q", mapped[:8])
    if n > min(_MAX_HEADER, size - 8):
        raise ValueError(f"header length {n} does not fit the file's {size} bytes")
    try:
        header = json.loads(bytes(mapped[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError(f"the safetensors header is a {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + n
    tensors = {}
    for name, info in header.items():
        try:
            dtype = _TORCH_DTYPE[info["dtype"]]
            start, end = (base + int(o) for o in info["data_offsets"])
            shape = [int(d) for d in info["shape"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"tensor {name!r}: bad header entry {info!r}") from exc
        count = end - start
        if not base <= start <= end <= size or count != dtype.itemsize * math.prod(shape):
            raise ValueError(f"tensor {name!r}: offsets {info['data_offsets']} do not hold shape {shape}")
        tensors[name] = _tensor_at(mapped, dtype, shape, start, count)
    return tensors, metadata
