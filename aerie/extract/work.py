"""The extraction stage: corpus in, hidden-state shards and their manifest out.

    run(cfg, ctx, corpus=..., server=...) -> StageResult

`ctx` is the `WorkContext` the stage (`aerie.extract.stage.EXTRACT`) hands over: `ctx.stage_dir`, the
extraction's StageDir (keyed by `aerie.extract.plan.extract_key`, worked out once by the stage), the
target and the progress callback. Nothing below derives the key again: the plan, the slices and the
fleet all write where `ctx.stage_dir` says.

plan (`aerie.extract.plan`: dirs, row ranges, the disk preflight before anything is launched) ->
run the servers (`aerie.extract.fleet`: per server, in threads, launch + readiness + canary, stream
batches, pack shards, upload them in the background, restart a dead server; teardown always) -> check
the token counts against the corpus and write the manifest last (`aerie.extract.stage_manifest`).

With `num_slices` > 1 the corpus is cut into num_slices x num_servers contiguous ranges and each slice
(one host with its own servers) can run anywhere against the same store (`aerie.extract.slices`): the
stage runs them as its parts and assembles them (`aerie.stage.run_parts`); `run` is one host's whole.
"""

from __future__ import annotations

import logging
import time

from aerie.errors import ConfigError
from aerie.extract import slices
from aerie.extract.config import ExtractConfig
from aerie.extract.fleet import extract
from aerie.extract.plan import check_server_quantization, plan
from aerie.extract.stage_manifest import manifest_body
from aerie.manifest import StageDir, StageResult
from aerie.serving import ServerConfig
from aerie.stage import WorkContext

log = logging.getLogger(__name__)


def run(
    cfg: ExtractConfig,
    ctx: WorkContext,
    *,
    corpus: StageResult,
    server: ServerConfig,
    rebuild_missing: bool = False,
) -> StageResult:
    """Extract the corpus's hidden states into shards, or return the cached result. A cached result
    whose shards are not all in the store is returned as it is unless `rebuild_missing`: then the
    missing shards are extracted again (the same bytes: shards depend only on the corpus order and
    the config) and the manifest is written anew. The pipeline asks for that only when a stage that
    reads the shards has to run (`aerie.pipeline.rebuild_missing`)."""
    if cfg.num_slices > 1:
        raise ConfigError(
            f"extract.num_slices={cfg.num_slices}: slices run as the extraction stage's parts "
            "(aerie.extract.stage.EXTRACT, or aerie.extract.slices.run_slice each), not as one host's work"
        )
    prepare(cfg, ctx.stage_dir, server=server, rebuild_missing=rebuild_missing)
    stage_dir, target, progress = ctx.stage_dir, ctx.target, ctx.progress
    cached = stage_dir.cached_result()
    if cached is not None:
        progress(1.0, "cached")
        return cached
    began = time.monotonic()
    progress(0.0, "reading the corpus, disk preflight")
    p = plan(cfg, ctx, corpus=corpus, server=server)
    results, canary = extract(cfg, p, store=stage_dir.store, target=target, server=server, progress=progress)
    canary_record = canary.result.record() if canary.result is not None else None
    seconds = time.monotonic() - began
    manifest = manifest_body(
        cfg, target, corpus, server, p.splits, results, p.preflight.record(), canary_record, seconds
    )
    result = stage_dir.finish(manifest)
    progress(1.0, f"{manifest['figures']['tokens']:,} tokens in {manifest['figures']['shards']} shards")
    return result


def prepare(cfg: ExtractConfig, stage_dir: StageDir, *, server: ServerConfig, rebuild_missing: bool) -> None:
    """Before any slice or server: the server's quantization checked against the config, and (with
    `rebuild_missing`) a finished extraction whose shards are not all in the store made unfinished
    again (its manifest and the records of the slices that lost shards deleted)."""
    check_server_quantization(cfg, server)
    if not rebuild_missing:
        return
    missing = slices.forget_missing(stage_dir, cfg.num_slices)
    if missing:
        log.warning(
            "extract %s: %d of its shards are not in the store (e.g. %s); extracting them again",
            stage_dir.prefix,
            len(missing),
            missing[0],
        )
