"""The entry points of a tokenization worker process.

Kept free of heavy imports at module level on purpose: the environment that pins each worker to one
thread (Polars, tokenizers' rayon pool, OpenMP) must be set before those libraries load, and a
spawned worker imports this module before its initializer runs. The initializer sets it, then loads
the encoder from a pickled payload.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

# One thread per worker process: the workers are the parallelism; nested pools would oversubscribe the cores.
WORKER_ENV = {
    "RAYON_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "POLARS_MAX_THREADS": "1",
    "OMP_NUM_THREADS": "1",
}

_ENCODER: Any = None


def initialize(payload: bytes) -> None:
    """Pin threads, then build the `BatchEncoder` from a pickled (TemplateSpec, EncodeOptions)."""
    global _ENCODER
    os.environ.update(WORKER_ENV)
    from aerie.corpus.encoding import BatchEncoder

    spec, options = pickle.loads(payload)
    _ENCODER = BatchEncoder(spec, options)


def encode(batch: bytes) -> Any:
    """One batch (Arrow IPC bytes of a Polars frame, see `pool.to_ipc`) -> `BatchResult`."""
    if _ENCODER is None:
        raise RuntimeError("tokenization worker used before its initializer ran")
    import io

    import polars as pl

    return _ENCODER(pl.read_ipc(io.BytesIO(batch)))
