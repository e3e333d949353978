"""Regenerate training conversations with the target through an OpenAI-compatible endpoint.

The stage entry point is `aerie.generate.stage.run(cfg, spec, store=..., run_name=..., base_url=...)`:
one dataset into `<run>/generate-<name>/<key>/conversations.parquet` (schema:
`aerie.generate.output.SCHEMA`). Kept import-free so that loading a config does not pull in httpx or
Polars.

    client.py     the async OpenAI-compatible client (retries, Retry-After, rate limits, errors)
    ratelimit.py  token buckets for requests/min and tokens/min
    turns.py      turn-by-turn regeneration of one conversation
    journal.py    the resumable append-only journal (group-committed, fsync'd)
    runner.py     one dataset's generation over any iterable of conversations
    output.py     the Parquet schema the corpus stage reads
    stage.py      run(): keys, cache, journal location, Parquet, errors, manifest
"""
