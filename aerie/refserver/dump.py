"""The dump contract shared by every extraction server (issue 6).

For a `/generate` request with rid R and `max_new_tokens: 0` the server writes
`<dump_dir>/R.safetensors` holding `input_ids [T]` (int32), `aux_hidden [T, kH]` and
`last_hidden [T, H]` (model dtype), and replies with `meta_info.dump = {"key", "shapes", "dtype"}`:
no float lists over HTTP. The file appears atomically (temp file, fsync, rename, fsync of the
directory), so a reader that sees `R.safetensors` sees all of it, even after a kill -9 mid-write.

The fp8 variant (`--dump-dtype fp8`; the default `model` is the above): the server quantizes on its
device (`aerie.fp8.quantize_fp8`, the scheme and tensor names of an fp8 shard) and the dump holds

    input_ids    int32          [T]
    aux_hidden   float8_e4m3fn  [T, kH]  codes; k = number of aux layers
    aux_scale    float32        [T, k]   one scale per token per aux layer
    last_hidden  float8_e4m3fn  [T, H]
    last_scale   float32        [T, 1]

with `dtype: "float8_e4m3fn"` in the reply (its `shapes` name the scales too). Dequantized =
codes * scale per group (`aerie.fp8.dequantize_fp8`). Only the reference server writes it: the
SGLang plugin always dumps the model dtype.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

from aerie.diskspace import writing
from aerie.errors import ExtractionError
from aerie.refserver.extraction import Capture

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

    The rename is durable once the caller runs `fsync_dir(dump_dir)` (once per batch of files,
    before replying); the file's own contents are fsynced here, before the rename publishes it.
    """
    from safetensors.torch import save_file

    tensors = {
        "input_ids": capture.input_ids.contiguous(),
        "aux_hidden": capture.aux_hidden.contiguous(),
        "last_hidden": capture.last_hidden.contiguous(),
    }
    if capture.aux_scale is not None and capture.last_scale is not None:
        tensors.update(aux_scale=capture.aux_scale.contiguous(), last_scale=capture.last_scale.contiguous())
    final = dump_dir / dump_key(rid)
    tmp = dump_dir / f"{TMP_PREFIX}{rid}.{uuid.uuid4().hex[:8]}"
    try:
        with writing(final, ExtractionError):  # a full disk, most often: say where, and the room left
            save_file(tensors, str(tmp), metadata=metadata)
            os.chmod(tmp, 0o644)  # readable by the extraction client even when it runs as another user
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
