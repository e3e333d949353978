"""Where a trained drafter lives in the store, and getting it onto local disk for a model or a server."""

from __future__ import annotations

import json
from pathlib import Path

from aerie.errors import EvaluationError
from aerie.families import DEFAULT
from aerie.manifest import StageResult
from aerie.store import ArtifactStore

DRAFTER_DIR = "drafter"
REQUIRED = ("config.json", "model.safetensors")


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
