"""The dump contract shared by every extraction server.

For a `/generate` request with rid R and `max_new_tokens: 0` the server writes
`<dump_dir>/R.safetensors` holding `input_ids [T]` (int32), `aux_hidden [T, kH]` and
`last_hidden [T, H]` (model dtype), and replies with `meta_info.dump = {"key", "shapes", "dtype"}`:
no float lists over HTTP. The file appears atomically (temp file, then rename), so a reader that sees
`R.safetensors` sees all of it, even after a kill -9 mid-write.

The fp8 variant (`--dump-dtype fp8`; the default `model` is the above): the server quantizes on its
device (`aerie.fp8.quantize_fp8`, the scheme and tensor names of an fp8 shard) and the dump holds

    input_ids    int32          [T]
    aux_hidden   float8_e4m3fn  [T, kH]  codes; k = number of aux layers
    aux_scale    uint8          [T, k]   one power-of-two scale (E8M0) per token per aux layer
    last_hidden  float8_e4m3fn  [T, H]
    last_scale   uint8          [T, 1]

with `dtype: "float8_e4m3fn"` in the reply (its `shapes` name the scales too). Dequantized =
codes * 2**(scale - 127) per group (`aerie.fp8.dequantize_fp8`). Only the reference server writes it: the
SGLang plugin always dumps the model dtype.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

from aerie.diskspace import writing
from aerie.engine.server.extraction import Capture
from aerie.errors import ExtractionError
from aerie.tensorfile import layout, whole, write_all

# A rid becomes a file name: keep it to one safe path component.
_RID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")
TMP_PREFIX = ".tmp-"


def check_rid(rid: str) -> str | None:
    """None if the rid can name a dump file, else what is wrong with it."""
    if _RID.match(rid) and ".." not in rid:
        return None
    return (
        f"rid {rid!r} cannot name a dump file: use 1-200 characters from [A-Za-z0-9._-], "
        "not starting with '.' or '-', without '..'"
    )


def dump_key(rid: str) -> str:
    return f"{rid}.safetensors"


def write_dump(
    dump_dir: Path, rid: str, capture: Capture, metadata: dict[str, str] | None = None
) -> dict[str, Any]:
    """Write one sample's tensors atomically; return the reply's `meta_info.dump`.

    Streamed from the capture's (pinned host) memory with writev (`aerie.tensorfile`): safetensors'
    `save_file` first copied every tensor into a `bytes` object holding the GIL, which on an H200 host
    held the dump writers to 351K tokens/s each and stalled the model thread's kernel launches.

    Not fsynced: a dump lives for one request. A reader that sees `R.safetensors` sees all of it,
    even after a kill -9 of the server mid-write (the rename publishes it, and written pages survive
    the process); what a crash of the machine loses is re-extracted, since only shards are kept.
    """
    tensors = {
        "input_ids": capture.input_ids,
        "aux_hidden": capture.aux_hidden,
        "last_hidden": capture.last_hidden,
    }
    if capture.aux_scale is not None and capture.last_scale is not None:
        tensors.update(aux_scale=capture.aux_scale, last_scale=capture.last_scale)
    # Widest elements first, as safetensors lays files out: every tensor then starts aligned to its
    # element size, which a reader mapping the file (the client) relies on.
    in_file = dict(sorted(tensors.items(), key=lambda kv: -kv[1].element_size()))
    final = dump_dir / dump_key(rid)
    tmp = dump_dir / f"{TMP_PREFIX}{rid}.{uuid.uuid4().hex[:8]}"
    try:
        with writing(final, ExtractionError):  # a full disk, most often: say where, and the room left
            parts, _ = layout(whole(in_file), _checked(metadata or {}))
            # 0o644: readable by the extraction client even when it runs as another user.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.fchmod(fd, 0o644)  # whatever the umask
                write_all(fd, parts)
            finally:
                os.close(fd)
            os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {
        "key": final.name,
        "shapes": {name: list(t.shape) for name, t in tensors.items()},
        "dtype": str(capture.aux_hidden.dtype).removeprefix("torch."),
    }


def _checked(metadata: dict[str, str]) -> dict[str, str]:
    """safetensors metadata is str -> str; say so before anything is written."""
    bad = {k: v for k, v in metadata.items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise TypeError(f"dump metadata must map str to str, got {bad!r}")
    return metadata
