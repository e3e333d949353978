"""The dump contract every extraction server implements, and its writer.

For a `/generate` request with rid R and `max_new_tokens: 0`, the server writes
`<dump_dir>/R.safetensors` holding::

    input_ids   int32       [T]
    aux_hidden  model dtype [T, kH]  residual stream entering the k captured layers (concatenated;
                                     EAGLE-3's 2, N//2, N-3 unless the server was told others)
    last_hidden model dtype [T, H]   after the final norm (the lm_head's input)

atomically (a temp name in the same directory, then rename), so a file that exists is complete.
A server that cannot produce R's states writes `<dump_dir>/R.error` (one line: why) instead, so the
client fails at once with the reason rather than waiting for a file that never comes.

This module runs inside the SGLang container too: it imports only the standard library, torch and
safetensors (all in the SGLang image) — never the rest of aerie.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger("aerie.sglang_plugin")

DUMP_SUFFIX = ".safetensors"
ERROR_SUFFIX = ".error"
PLUGIN_ERROR_FILE = "plugin.error"  # written when the plugin itself failed to attach
DUMP_KEYS = ("input_ids", "aux_hidden", "last_hidden")
# A rid becomes a file name: keep it to a portable, traversal-free alphabet.
_RID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def valid_rid(rid: str) -> bool:
    return bool(_RID.match(rid))


def dump_path(dump_dir: str | os.PathLike[str], rid: str) -> Path:
    if not valid_rid(rid):
        raise ValueError(f"rid {rid!r} cannot name a dump file (use letters, digits, '.', '_', '-')")
    return Path(dump_dir) / f"{rid}{DUMP_SUFFIX}"


def error_path(dump_dir: str | os.PathLike[str], rid: str) -> Path:
    return Path(dump_dir) / f"{rid}{ERROR_SUFFIX}"


def _atomic_replace(tmp: Path, dest: Path) -> None:
    os.replace(tmp, dest)


def _layers_wide(aux_hidden: torch.Tensor, last_hidden: torch.Tensor) -> bool:
    """Whether `aux_hidden` [T, kH] holds a whole number k >= 1 of layers of `last_hidden`'s width H
    (the shard writer checks k against the extraction's layer count)."""
    h, width = int(last_hidden.shape[-1]), int(aux_hidden.shape[-1])
    return aux_hidden.dim() == 2 and h > 0 and width >= h and width % h == 0


def write_dump(
    dump_dir: str | os.PathLike[str],
    rid: str,
    input_ids: torch.Tensor,
    aux_hidden: torch.Tensor,
    last_hidden: torch.Tensor,
) -> dict[str, object]:
    """Write one request's dump atomically; returns the reply's `meta_info.dump` body."""
    dest = dump_path(dump_dir, rid)
    t = int(input_ids.shape[0])
    if aux_hidden.shape[0] != t or last_hidden.shape[0] != t or not _layers_wide(aux_hidden, last_hidden):
        raise ValueError(
            f"dump {rid}: shapes do not agree: input_ids {tuple(input_ids.shape)}, "
            f"aux_hidden {tuple(aux_hidden.shape)}, last_hidden {tuple(last_hidden.shape)}"
        )
    tensors = {
        "input_ids": input_ids.detach().to("cpu", torch.int32).contiguous(),
        "aux_hidden": aux_hidden.detach().cpu().contiguous(),
        "last_hidden": last_hidden.detach().cpu().contiguous(),
    }
    tmp = dest.with_name(f".{dest.name}.tmp")
    try:
        save_file(tensors, str(tmp))
        _atomic_replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {
        "key": dest.name,
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
        "dtype": str(tensors["aux_hidden"].dtype).removeprefix("torch."),
    }


def write_error(dump_dir: str | os.PathLike[str], rid: str, message: str) -> None:
    """Record why R has no dump (atomically, like a dump)."""
    dest = error_path(dump_dir, rid)
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.write_text(message.strip() + "\n")
    _atomic_replace(tmp, dest)


def read_dump(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Load a dump and check it holds the contract's tensors with agreeing shapes."""
    return check_dump(load_file(str(path)), path)


def check_dump(tensors: dict[str, torch.Tensor], path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """`tensors` (a dump's, however it was read), after checking they hold the contract's tensors
    with agreeing shapes; `ValueError` naming `path` otherwise."""
    missing = [k for k in DUMP_KEYS if k not in tensors]
    if missing:
        raise ValueError(f"{path}: dump lacks {missing}")
    t = tensors["input_ids"].shape[0]
    h = tensors["last_hidden"].shape[-1]
    aux, last = tensors["aux_hidden"], tensors["last_hidden"]
    if aux.shape[0] != t or tuple(last.shape) != (t, h) or not _layers_wide(aux, last):
        raise ValueError(
            f"{path}: shapes do not agree: input_ids [{t}], aux_hidden {list(tensors['aux_hidden'].shape)}, "
            f"last_hidden {list(tensors['last_hidden'].shape)}"
        )
    return tensors


@dataclass
class RequestSlice:
    """One request's rows of a packed extend batch."""

    rid: str
    start: int
    length: int
    prefix_len: int


def split_packed(
    rids: Sequence[str], extend_lens: Sequence[int], prefix_lens: Sequence[int] | None = None
) -> list[RequestSlice]:
    """Where each request's tokens sit in a packed extend batch (requests are concatenated along
    tokens in batch order; `extend_lens[i]` tokens each). `prefix_lens[i] > 0` means the server
    reused a cached prefix, so the batch holds only the suffix of that request."""
    if len(rids) != len(extend_lens):
        raise ValueError(f"{len(rids)} rids but {len(extend_lens)} extend lengths")
    prefix = list(prefix_lens) if prefix_lens is not None else [0] * len(rids)
    out, start = [], 0
    for rid, length, pre in zip(rids, extend_lens, prefix, strict=True):
        out.append(RequestSlice(rid=rid, start=start, length=int(length), prefix_len=int(pre)))
        start += int(length)
    return out


@dataclass
class _Job:
    rid: str
    input_ids: torch.Tensor
    aux_hidden: torch.Tensor
    last_hidden: torch.Tensor
    ready: object | None = None  # a torch.cuda.Event the copy to host must reach first


class DumpWriter:
    """Writes dumps from a background thread so the forward pass does not wait on the disk.

    The queue is bounded: when the disk is slower than the GPU, `submit` blocks the forward pass
    (back-pressure) instead of piling host copies up in memory.
    """

    def __init__(self, dump_dir: str | os.PathLike[str], max_pending: int = 64) -> None:
        self.dump_dir = Path(dump_dir)
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max_pending)
        self.written = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name="aerie-dump-writer", daemon=True)
        self._thread.start()

    def submit(
        self,
        rid: str,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        last_hidden: torch.Tensor,
        ready: object | None = None,
    ) -> None:
        self._queue.put(_Job(rid, input_ids, aux_hidden, last_hidden, ready))

    def error(self, rid: str, message: str) -> None:
        logger.error("aerie dump %s: %s", rid, message)
        try:
            write_error(self.dump_dir, rid, message)
        except OSError:
            logger.exception("aerie dump %s: cannot write the error file", rid)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                self._queue.task_done()
                return
            try:
                if job.ready is not None:
                    job.ready.synchronize()  # type: ignore[attr-defined]
                write_dump(self.dump_dir, job.rid, job.input_ids, job.aux_hidden, job.last_hidden)
                self.written += 1
            except Exception as exc:  # one bad request must not stop the writer
                self.failed += 1
                self.error(job.rid, f"writing the dump failed: {type(exc).__name__}: {exc}")
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every submitted dump is on disk."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
