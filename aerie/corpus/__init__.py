"""Merge conversations into a tokenized training corpus with assistant-only loss masks.

The stage entry point is `run(cfg, ctx, inputs=[...])` (stage `merge`; `ctx` the `aerie.stage.WorkContext`);
`iter_corpus` / `corpus_shards` read its output. Attributes load lazily so that importing the config
does not pull in Polars or transformers.

    config.py    CorpusConfig
    schema.py    the input contract (conversations.parquet) and the corpus columns; schema checks
    validate.py  per-conversation checks (roles, empty turns, truncation policy) and the content hash
    template.py  chat-template rendering and template-derived loss masks (fast and slow tokenizers)
    encoding.py  one batch: check, place, render, tokenize; the worker process pool
    shuffle.py   hash-keyed split and shuffle, the bounded-memory spill, per-shard dedupe
    stats.py     records/tokens per source, supervised fraction, token counts, length histogram
    work.py      run(): key, cache, orchestration, manifest
    stage.py     MERGE: the stage in the pipeline
    imports.py   raw datasets (Conversation objects) as stage results merge can read
    reader.py    iter_corpus, corpus_shards, CorpusRow
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "run": "aerie.corpus.work",
    "STAGE": "aerie.corpus.work",
    "iter_corpus": "aerie.corpus.reader",
    "corpus_shards": "aerie.corpus.reader",
    "CorpusRow": "aerie.corpus.reader",
    "import_conversations": "aerie.corpus.imports",
    "conversations_frame": "aerie.corpus.schema",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'aerie.corpus' has no attribute {name!r}")
