"""Hidden-state extraction: the corpus through the target's server into compact, resumable shards.

stage.py           EXTRACT: the stage in the pipeline
work.py            `run(cfg, ctx, corpus=, server=) -> StageResult` (ctx.stage_dir: its StageDir), top to bottom
plan.py            what is decided before a server starts: the key, dirs, row ranges, disk preflight
fleet.py           one host's servers in threads, uploads behind them, teardown always
stage_manifest.py  the manifest, checked against the corpus, and the run's figures
slices.py          one slice of a multi-host extraction, and assembling the slices
worker.py          one server and its corpus slice: ordered commits, restarts
commit.py          the commit path: samples encoded on several threads, appended in order, shards written behind
client.py          `/generate` batches and the dump files they produce
canary.py          proves a fresh server writes the right hidden states before any shard is written
preflight.py       refuses, with the numbers, when the disk cannot hold the result
resume.py          progress.json: the shards already safe in the store
uploads.py         background, verified uploads of closed shards
corpus_rows.py     the corpus in a fixed, indexable order, sliced per server
(the shard format itself, shared with training, is `aerie.shards`)
"""
# Kept import-free: aerie.config imports aerie.extract.config, and loading a config must not pull torch.
