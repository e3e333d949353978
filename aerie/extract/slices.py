"""One slice of a multi-host extraction, and the assembly of the finished slices into the stage.

    run_slice(cfg, k, ctx, corpus=, server=) -> SliceRecord
    assemble(cfg, ctx, corpus=, server=) -> StageResult

`ctx` is the stage's `WorkContext`: its `stage_dir`, the extraction's StageDir (made by whoever runs the
slice from `extract_key`: the stage, or the flow of one slice), the target and the progress callback.

With `num_slices` = n, every split is cut into n x num_servers contiguous row ranges and slice k is one
host running ranges k*num_servers .. (k+1)*num_servers - 1 through its own servers. Slices share
nothing but the store: each writes its shards (named by global server index, so the layout is the one
a single host with n x num_servers servers writes), its own progress object (`resume.progress_key`;
one writer per object) and, last, its record `slices/slice-<k>-of-<n>.json`. A slice whose record
exists is done: running it again launches nothing. `assemble` (any host, once every slice is done)
builds the stage manifest from the records, refusing unless the shards hold exactly the corpus; with
the manifest written, it is a cache hit like any stage.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from aerie.errors import ConfigError, ExtractionError, StoreError, TargetError
from aerie.extract.config import ExtractConfig
from aerie.extract.corpus_rows import SplitFiles, open_split
from aerie.extract.fleet import extract
from aerie.extract.phases import PhaseTotals
from aerie.extract.plan import Plan, plan, work_dir
from aerie.extract.resume import ClosedShard
from aerie.extract.stage_manifest import manifest_body
from aerie.extract.worker import SliceResult
from aerie.manifest import MANIFEST, StageDir, StageResult
from aerie.serving import ServerConfig
from aerie.shards.keys import missing_shards
from aerie.stage import WorkContext
from aerie.targets import TargetConfig, TargetInfo, resolve_target


class SliceMissingError(ExtractionError):
    """The stage cannot be assembled: a slice has not finished (no record in the store)."""


class SliceRecord(BaseModel):
    """What a finished slice leaves in the store; `assemble` builds the manifest from these."""

    slice: int
    num_slices: int
    servers: list[int] = Field(description="Global indices of the slice's servers (= its row ranges).")
    host: str
    shards: list[dict[str, Any]] = Field(description="The slice's shards (ClosedShard records).")
    tokens: int = Field(description="Tokens extracted by the run that finished the slice (not resumed).")
    restarts: int
    resumed_rows: int
    pump_seconds: float
    commit_seconds: float = 0.0
    phases: dict[str, Any] | None = Field(
        None, description="The slowest server's phase seconds (PhaseTotals.record); None in older records."
    )
    seconds: float
    canary: dict[str, Any] | None
    preflight: dict[str, Any]

    def result(self) -> SliceResult:
        return SliceResult(
            slice=self.slice,
            shards=[ClosedShard(**s) for s in self.shards],
            tokens=self.tokens,
            restarts=self.restarts,
            resumed_rows=self.resumed_rows,
            pump_seconds=self.pump_seconds,
            commit_seconds=self.commit_seconds,
            phases=PhaseTotals.from_record(self.phases),
        )


def record_name(slice_index: int, num_slices: int) -> str:
    return f"slices/slice-{slice_index}-of-{num_slices}.json"


def read_record(stage_dir: StageDir, slice_index: int, num_slices: int) -> SliceRecord | None:
    """The slice's record, or None when it has not finished (a corrupt record counts as unfinished:
    re-running the slice resumes from its progress object and rewrites it)."""
    try:
        return SliceRecord.model_validate_json(
            stage_dir.store.get_bytes(stage_dir.path(record_name(slice_index, num_slices)))
        )
    except (StoreError, ValidationError, ValueError):  # ObjectNotFoundError is a StoreError
        return None


def forget_missing(stage_dir: StageDir, num_slices: int) -> list[str]:
    """Make a finished extraction whose shards are not all in the store unfinished again, so that a
    re-run extracts what is missing and only that: its manifest goes, and with slices the records of
    the slices that lost shards (a slice with a record is never run again; its progress object
    resumes it after the shards still there). Returns the missing shard keys; none: nothing done."""
    cached = stage_dir.cached_result()
    if cached is None:
        return []
    missing = missing_shards(stage_dir.store, cached)
    if not missing:
        return []
    lost = set(missing)
    for k in range(num_slices if num_slices > 1 else 0):
        record = read_record(stage_dir, k, num_slices)
        if record is not None and any(f"{stage_dir.prefix}/{r['path']}" in lost for r in record.shards):
            stage_dir.store.delete(stage_dir.path(record_name(k, num_slices)))
    stage_dir.store.delete(stage_dir.path(MANIFEST))
    return missing


def run_slice(
    cfg: ExtractConfig,
    slice_index: int,
    ctx: WorkContext,
    *,
    corpus: StageResult,
    server: ServerConfig,
) -> SliceRecord:
    """Extract slice `slice_index` of `cfg.num_slices` on this host (preflight, its own servers,
    uploads, teardown) and write its record last. A finished slice returns its record at once."""
    n = cfg.num_slices
    if not 0 <= slice_index < n:
        raise ConfigError(f"extract slice index {slice_index} is outside 0..{n - 1} (extract.num_slices={n})")
    stage_dir, store, target, progress = ctx.stage_dir, ctx.store, ctx.target, ctx.progress
    done = read_record(stage_dir, slice_index, n)
    if done is not None:
        progress(1.0, f"slice {slice_index} of {n}: already done")
        return done
    began = time.monotonic()
    progress(0.0, f"slice {slice_index} of {n}: reading the corpus, disk preflight")
    p = plan(cfg, ctx, corpus=corpus, server=server, slice_index=slice_index)
    results, canary = extract(cfg, p, store=store, target=target, server=server, progress=progress)
    _check_complete(p, results, slice_index, n)
    record = SliceRecord(
        slice=slice_index,
        num_slices=n,
        servers=list(p.servers),
        host=socket.gethostname(),
        shards=[s.record() for r in results for s in r.shards],
        tokens=sum(r.tokens for r in results),
        restarts=sum(r.restarts for r in results),
        resumed_rows=sum(r.resumed_rows for r in results),
        pump_seconds=max((r.pump_seconds for r in results), default=0.0),
        commit_seconds=max((r.commit_seconds for r in results), default=0.0),
        phases=max(results, key=lambda r: r.pump_seconds).phases.record() if results else None,
        seconds=round(time.monotonic() - began, 3),
        canary=canary.result.record() if canary.result is not None else None,
        preflight=p.preflight.record(),
    )
    # Written last: the record is what says "this slice is done".
    store.put_bytes(stage_dir.path(record_name(slice_index, n)), record.model_dump_json(indent=1).encode())
    progress(1.0, f"slice {slice_index} of {n}: {sum(s['tokens'] for s in record.shards):,} tokens")
    return record


def _check_complete(p: Plan, results: list[SliceResult], slice_index: int, n: int) -> None:
    """Each server's shards chain over exactly its row range of every split (else no record)."""
    for i, result in enumerate(results):
        for split, ranges in p.bounds.items():
            lo, hi = ranges[i]
            mine = sorted((s for s in result.shards if s.split == split), key=lambda s: s.index)
            row = lo
            for s in mine:
                if s.first_row != row:
                    break
                row = s.end_row
            if row != hi:
                raise ExtractionError(
                    f"slice {slice_index} of {n}, server s{result.slice}, {split}: its shards cover rows "
                    f"{lo}..{row} of {lo}..{hi}; not writing the slice record"
                )


def assemble(
    cfg: ExtractConfig, ctx: WorkContext, *, corpus: StageResult, server: ServerConfig
) -> StageResult:
    """Write the stage manifest from the slice records (`SliceMissingError` naming the unfinished
    slices; `ExtractionError` unless the shards hold exactly the corpus). A cache hit once written."""
    stage_dir, store, progress = ctx.stage_dir, ctx.store, ctx.progress
    cached = stage_dir.cached_result()
    if cached is not None:
        progress(1.0, "cached")
        return cached
    n = cfg.num_slices
    records = [read_record(stage_dir, k, n) for k in range(n)]
    missing = [k for k, r in enumerate(records) if r is None]
    if missing:
        names = ", ".join(f"slice {k} of {n} ({stage_dir.path(record_name(k, n))})" for k in missing)
        raise SliceMissingError(
            f"cannot assemble the extraction at {stage_dir.prefix}: not finished: {names}; run the missing "
            "slices (extract_slice_flow, or aerie.extract.slices.run_slice) first"
        )
    done = [r for r in records if r is not None]
    work = work_dir(cfg, stage_dir.run, stage_dir.key)
    splits: dict[str, SplitFiles] = {
        s: open_split(store, corpus.prefix, s, work / "corpus") for s in cfg.splits
    }
    canary = next((r.canary for r in done if r.canary is not None), None)
    manifest = manifest_body(
        cfg,
        ctx.target,
        corpus,
        server,
        splits,
        [r.result() for r in done],
        {"slices": [r.preflight for r in done]},
        canary,
        max(r.seconds for r in done),  # the slices ran side by side
    )
    manifest["server"]["num_slices"] = n
    manifest["slices"] = [
        {"slice": r.slice, "host": r.host, "servers": r.servers, "seconds": r.seconds, "tokens": r.tokens}
        for r in done
    ]
    result = stage_dir.finish(manifest)
    progress(
        1.0, f"assembled {n} slices: {result.figures['tokens']:,} tokens in {result.figures['shards']} shards"
    )
    return result


def local_target(target: TargetInfo) -> TargetInfo:
    """The target as this host has it. A slice may run on another host than the one that resolved the
    target; it needs the same weights (same revision) here, resolved again by name when the path differs."""
    if (Path(target.path) / "config.json").is_file():
        return target
    here = resolve_target(
        TargetConfig(name=target.name, revision=target.revision, trust_remote_code=target.trust_remote_code)
    )
    if here.revision != target.revision:
        raise TargetError(
            f"target {target.name} on {socket.gethostname()} is revision {here.revision}, the run's is "
            f"{target.revision}: stage the same weights on every extraction host"
        )
    return here
