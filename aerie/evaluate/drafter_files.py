"""Where a trained drafter lives in the store, getting it onto local disk for a model or a server, and
checking a drafter directory before anything is loaded for it.

`check_drafter_dir` reads only the directory's small parts (config.json, the safetensors header, each
file's size, aerie.json), so a drafter that cannot load fails in milliseconds, not after the target
has loaded: a missing file, a safetensors file cut short (its header promises more bytes than the
file holds) or whose header is not safetensors', and a drafter trained for another target or revision
than the one given (its `aerie.json`), which would measure nothing meaningful.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from aerie.errors import EvaluationError
from aerie.families import DEFAULT
from aerie.manifest import StageResult
from aerie.store import ArtifactStore

DRAFTER_DIR = "drafter"
REQUIRED = ("config.json", "model.safetensors")
# Bytes per element of the safetensors dtypes a drafter holds.
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2}
_DTYPE_BYTES |= {"BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def check_drafter_files(drafter_dir: str | Path) -> None:
    """Raise `EvaluationError` naming what is wrong when `drafter_dir` is not a complete drafter."""
    where = Path(drafter_dir)
    if not where.is_dir():
        raise EvaluationError(f"drafter directory {where} does not exist (or is not a directory)")
    missing = [n for n in REQUIRED if not (where / n).is_file()]
    if missing:
        found = sorted(p.name for p in where.iterdir())
        raise EvaluationError(
            f"drafter directory {where} lacks {missing} (found {found or 'nothing'}): a drafter is the "
            "train stage's drafter/ folder, config.json, model.safetensors and aerie.json"
        )
    _read_json(where / "config.json")
    check_safetensors(where / "model.safetensors")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise EvaluationError(f"{path} cannot be read as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise EvaluationError(f"{path} holds a {type(data).__name__}, not a JSON object")
    return data


def check_safetensors(path: Path) -> None:
    """The file's header parses and every tensor's bytes are inside the file: one cut short (a copy
    that stopped, a full disk) fails here instead of deep in a load."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            if length is None or not 2 <= length <= min(_MAX_HEADER, size - 8):
                raise ValueError(f"a header length of {length} in a file of {size} bytes")
            header = json.loads(f.read(length))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise EvaluationError(f"{path} is not a readable safetensors file ({exc})") from exc
    data = size - 8 - length
    try:
        end = max(
            (_tensor_end(path, name, entry) for name, entry in header.items() if name != "__metadata__"),
            default=0,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise EvaluationError(f"{path} has a safetensors header aerie cannot read ({exc!r})") from exc
    if end > data:
        raise EvaluationError(
            f"{path} is cut short: its header places tensors up to byte {end:,} of the data, and the file "
            f"holds {data:,} ({size:,} bytes in all); copy the drafter again"
        )


def _tensor_end(path: Path, name: str, entry: dict[str, Any]) -> int:
    """Where a tensor's bytes end in the data section, once its span is checked against its shape."""
    begin, stop = (int(x) for x in entry["data_offsets"])
    width = _DTYPE_BYTES.get(entry["dtype"])
    if width is not None and stop - begin != math.prod(entry["shape"]) * width:
        raise EvaluationError(
            f"{path}: tensor {name!r} spans {stop - begin} bytes; its shape {entry['shape']} of "
            f"{entry['dtype']} needs {math.prod(entry['shape']) * width}"
        )
    return stop


def check_trained_for(drafter_dir: Path, target_name: str, target_revision: str | None) -> None:
    """The drafter's `aerie.json` names this target (and this revision, where both are known). A drafter
    without one (exported by another tool) is not checked."""
    path = Path(drafter_dir) / "aerie.json"
    if not path.is_file():
        return
    provenance = _read_json(path)
    name, revision = provenance.get("target"), provenance.get("target_revision")
    if name is not None and str(name) != target_name:
        raise EvaluationError(
            f"the drafter at {drafter_dir} was trained for target {name!r} (its aerie.json), not {target_name!r}: "
            "choose the preset or target.name it was trained for, or pass --allow-other-target to measure it anyway"
        )
    if revision and target_revision and str(revision) != target_revision:
        raise EvaluationError(
            f"the drafter at {drafter_dir} was trained for {name!r} at revision {revision} (its aerie.json), "
            f"and the target given is at revision {target_revision}: set target.revision={revision}, or pass "
            "--allow-other-target to measure it anyway"
        )


def family_of(drafter_dir: Path) -> str:
    """The family an exported drafter belongs to, from its provenance (`aerie.json`; an export of the
    default family written before families existed has none)."""
    try:
        provenance = json.loads((Path(drafter_dir) / "aerie.json").read_text())
    except (OSError, ValueError):
        return DEFAULT
    return str(provenance.get("family", DEFAULT)) if isinstance(provenance, dict) else DEFAULT


def drafter_keys(store: ArtifactStore, train: StageResult) -> list[str]:
    """Store keys of the drafter directory a train stage wrote (`<prefix>/drafter/*`)."""
    prefix = f"{train.prefix}/{DRAFTER_DIR}/"
    keys = [k for k in store.list(prefix) if k.startswith(prefix)]
    names = {k[len(prefix) :] for k in keys}
    missing = [n for n in REQUIRED if n not in names]
    if missing:
        raise EvaluationError(
            f"the train stage at {train.prefix} has no complete drafter: {prefix} lacks {missing} "
            f"(found {sorted(names) or 'nothing'})"
        )
    return keys


def name_in_drafter(key: str) -> str:
    """A drafter file's path inside the drafter directory (`vllm/config.json` for vLLM's layout): the
    directory has a subfolder, so a bare file name would put vLLM's config.json over SGLang's."""
    return key.split(f"/{DRAFTER_DIR}/", 1)[1]


def fetch_drafter(store: ArtifactStore, train: StageResult, dest: Path) -> Path:
    """A local directory holding the drafter: the store's own files when it is local, else a copy in
    `dest` (a directory SGLang's `--speculative-draft-model-path` and `load_drafter` both read)."""
    keys = drafter_keys(store, train)
    local = [store.local_path(k) for k in keys]
    if all(p is not None and p.is_file() for p in local):
        first = local[0]
        assert first is not None
        return first.parent
    dest.mkdir(parents=True, exist_ok=True)
    for key in keys:
        store.get_file(key, dest / name_in_drafter(key))
    return dest
