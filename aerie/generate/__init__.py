"""Regenerate training conversations with the target through an OpenAI-compatible endpoint.

    run(cfg, spec, stage_dir, base_url=)   one dataset into its StageDir (<run>/generate-<name>/<key>/)

Each dataset writes `conversations.parquet` (schema `aerie.generate.output.SCHEMA`), `errors.jsonl`
and its manifest.

    client.py     the async OpenAI-compatible client (retries, Retry-After, rate limits, errors)
    transport.py  a lean HTTP/1.1 keep-alive pool under httpx
    preflight.py  one GET before generation: the endpoint answers and accepts the key
    ratelimit.py  token buckets for requests/min and tokens/min
    turns.py      turn-by-turn regeneration of one conversation
    journal.py    the resumable append-only journal (group-committed, fsync'd)
    runner.py     one dataset's generation over any iterable of conversations
    output.py     the Parquet schema the corpus stage reads
    work.py       run(): keys (`key_of`), cache, journal location, Parquet, errors, manifest
    stage.py      GENERATE: the stage in the pipeline, a part per dataset in parallel up to a limit,
                  around one endpoint
    server.py     the embedded endpoint: the configured server launched to serve the target for
                  generation, with its chat template and reasoning parser
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aerie.generate.work import run, stage_name

__all__ = ["run", "stage_name"]


def __getattr__(name: str) -> Any:
    # Lazy: `aerie.config` imports `aerie.generate.config`, and loading a config must not pay for
    # httpx and Polars.
    if name in __all__:
        from aerie.generate import work

        return getattr(work, name)
    raise AttributeError(f"module 'aerie.generate' has no attribute {name!r}")
