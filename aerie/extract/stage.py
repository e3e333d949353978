"""The extraction stage: corpus in, hidden-state shards and their manifest out.

    run(cfg, store=..., run_name=..., target=..., corpus=..., server=...) -> StageResult

preflight (disk, before anything is launched) -> per server slice, in threads: launch + readiness +
canary (`ModelServer` with `ExtractionCanary`), stream batches, pack shards, upload them in the
background, restart a dead server -> teardown (always) -> check the token counts against the corpus
-> manifest (written last).

With `num_slices` > 1 the corpus is cut into num_slices x num_servers contiguous ranges and each slice
(one host with its own servers) can run anywhere against the same store: see `aerie.extract.slices`.

The stage key covers what changes the shards' contents or layout (storage dtype, shard size, server
count over all slices, splits), the server backend, the target and its revision and the corpus manifest
digest; operational knobs (batch size, requests in flight, restarts, timeouts, work dir, commit workers and buffer,
and where fp8 is quantized: `quantize_device`, `quantize_on_server`, one function on identical inputs,
byte-identical shards) are left out, so changing them does not throw away uploaded shards on a re-run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aerie.errors import ConfigError, DataError, ExtractionError, StoreError
from aerie.extract import preflight as disk
from aerie.extract.canary import ExtractionCanary, fits_in_memory, pick_sample
from aerie.extract.config import ExtractConfig, server_quantization_problem
from aerie.extract.corpus_rows import SplitFiles, open_split, slice_bounds
from aerie.extract.resume import ClosedShard, ProgressFile, progress_key
from aerie.extract.shards import SHARD_SCHEMA_VERSION, bytes_per_token
from aerie.extract.uploads import Uploader
from aerie.extract.worker import SliceResult, SliceWorker, TokenMeter
from aerie.hostlock import HeldElsewhere, HostLock
from aerie.manifest import StageDir, StageResult, load_manifest, stage_key
from aerie.progress import ProgressFn, no_progress
from aerie.serving import ModelServer, ServerConfig, spec_for
from aerie.settings import get_settings
from aerie.store import ArtifactStore
from aerie.targets import TargetInfo

log = logging.getLogger(__name__)

STAGE = "extract"
SHM_DUMPS = Path("/dev/shm/aerie-extract")
KEY_FIELDS = ("storage_dtype", "shard_bytes", "num_servers", "splits")


def extract_key(cfg: ExtractConfig, server: ServerConfig, target: TargetInfo, corpus: StageResult) -> str:
    extract = cfg.model_dump(mode="json", include=set(KEY_FIELDS))
    # The shard layout is decided by the number of contiguous ranges, not by how many hosts run them:
    # 2 hosts x 1 server write exactly the shards of 1 host x 2 servers (and a 1-slice key is unchanged).
    extract["num_servers"] = total_servers(cfg)
    config = {
        "extract": extract,
        # A new shard layout is a new extraction: a resume never mixes shards of two schemas.
        "shard_schema_version": SHARD_SCHEMA_VERSION,
        "server_backend": server.backend,
        "target": target.name,
        "target_revision": target.revision,
    }
    return stage_key(STAGE, config, [corpus.manifest_sha256])


def stage_dir(
    cfg: ExtractConfig,
    store: ArtifactStore,
    run_name: str,
    target: TargetInfo,
    corpus: StageResult,
    server: ServerConfig,
) -> StageDir:
    """Where this extraction's manifest, shards, progress and slice records live in the store."""
    return StageDir(store, run_name, STAGE, extract_key(cfg, server, target, corpus))


def shard_keys(extract: dict[str, Any], prefix: str) -> tuple[list[str], list[str]]:
    """Store keys of the train and eval shards an extract manifest lists (no splits: all are train)."""

    def keys(records: list[dict[str, Any]]) -> list[str]:
        return [f"{prefix}/{r.get('path') or r['name']}" for r in records]

    splits = extract.get("splits")
    if splits:
        train = keys(splits.get("train", {}).get("shards", []))
        held = keys(splits.get("eval", {}).get("shards", []))
    else:
        train, held = keys(extract.get("shards", [])), []
    if not train:
        raise DataError(f"the extract stage at {prefix} lists no training shards")
    return train, held


def missing_shards(store: ArtifactStore, result: StageResult) -> list[str]:
    """The shards `result`'s manifest lists that the store does not hold: a manifest that travelled
    without its shards (`python -m tools.gpuhost` packs out manifests, never hidden states), or shards
    deleted since."""
    train, held = shard_keys(load_manifest(store, result.prefix), result.prefix)
    return [key for key in (*train, *held) if not store.exists(key)]


def total_servers(cfg: ExtractConfig) -> int:
    return cfg.num_servers * cfg.num_slices


def servers_of(cfg: ExtractConfig, slice_index: int | None) -> range:
    """The global indices of the servers one host runs: slice k owns ranges k*num_servers.. of the
    num_slices x num_servers ranges; a single-host run (None) owns its num_servers ranges."""
    first = (slice_index or 0) * cfg.num_servers
    return range(first, first + cfg.num_servers)


def work_dir(cfg: ExtractConfig, run_name: str, key: str) -> Path:
    if cfg.work_dir:
        return Path(cfg.work_dir).expanduser().resolve() / run_name / key
    return Path(get_settings().cache_dir) / "extract" / run_name / key


def dump_root(
    cfg: ExtractConfig, run_name: str, key: str, work: Path, hidden_size: int, vocab_size: int | None = None
) -> Path:
    """Dumps are written once and read back once: on tmpfs when it has room for twice the dumps in
    flight (so a disk-bound host spends its disk bandwidth on shards only), else in the work dir."""
    if cfg.dump_dir:
        return Path(cfg.dump_dir).expanduser().resolve() / run_name / key
    shm = Path("/dev/shm")
    need = 2 * disk.dumps_in_flight_bytes(cfg, hidden_size, vocab_size)
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= need:
        return SHM_DUMPS / run_name / key
    return work / "dumps"


def _remove_dump_root(root: Path) -> None:
    """Remove a tmpfs dump root and the parents it left empty (run dir, aerie-extract)."""
    shutil.rmtree(root, ignore_errors=True)
    if root.parent.parent != SHM_DUMPS:
        return
    for parent in (root.parent, SHM_DUMPS):
        try:
            parent.rmdir()
        except OSError:
            break


def _quantize_device(cfg: ExtractConfig) -> str:
    # auto = cpu: the commit pool's threads scale with the cores, while per-sample GPU quantization
    # (what auto meant before) waits on transfers and on the server's forward passes sharing the GPU.
    return "cpu" if cfg.quantize_device == "auto" else cfg.quantize_device


def check_server_quantization(cfg: ExtractConfig, server: ServerConfig) -> None:
    """`ConfigError` where `quantize_on_server` cannot run (`server_quantization_problem`): the configs
    refuse it at load, but a `model_copy` skips validation."""
    problem = server_quantization_problem(cfg, server.backend)
    if problem:
        raise ConfigError(problem)


def _server_args(server: ServerConfig, cfg: ExtractConfig) -> list[str]:
    """Flags the stage adds to the reference server's command line (none for SGLang).

    One request, one packed forward: the reference server packs waiting sequences up to its
    `--max-batch-tokens` (16,384 by default), which split the preset's 65,536-token requests into four
    smaller forwards (on the H200: 489K tokens/s at 16K-token packs, 613K at 64K). A value the server
    config already sets is kept. With `quantize_on_server`, `--dump-dtype fp8`: the server quantizes
    each pack on its device and the dumps hold the shards' fp8 codes and scales."""
    if server.backend != "reference":
        return []
    args = [] if "--max-batch-tokens" in server.extra_args else ["--max-batch-tokens", str(cfg.batch_tokens)]
    if cfg.quantize_on_server and cfg.storage_dtype == "fp8":
        args += ["--dump-dtype", "fp8"]
    return args


def _server_cfg(server: ServerConfig, index: int, local: int, num_local: int) -> ServerConfig:
    """Server `index` (global) of a fan-out: its own port (by global index, so slices sharing a host
    never collide) and, when one host runs several, its own GPU group (by its index on this host)."""
    env = dict(server.env)
    if num_local > 1 and server.device != "cpu" and "CUDA_VISIBLE_DEVICES" not in env:
        first = local * server.tp_size
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(server.tp_size))
    return server.model_copy(update={"port": server.port + index, "env": env})


@dataclass
class Plan:
    """Everything decided before a server is launched."""

    stage: StageDir
    work: Path
    dumps: Path
    splits: dict[str, SplitFiles]
    tokens: int
    progress_file: ProgressFile
    preflight: disk.PreflightReport
    servers: range  # global indices of the servers this host runs
    bounds: dict[str, list[tuple[int, int]]]  # per split, the row range of each of those servers


def plan(
    cfg: ExtractConfig,
    *,
    store: ArtifactStore,
    run_name: str,
    target: TargetInfo,
    corpus: StageResult,
    server: ServerConfig,
    slice_index: int | None = None,
) -> Plan:
    """Read the corpus counts and the resume state, and run the disk preflight (`PreflightError`).
    `slice_index` plans one slice of a multi-host run (its own progress object and dump root)."""
    check_server_quantization(cfg, server)
    stage = stage_dir(cfg, store, run_name, target, corpus, server)
    work = work_dir(cfg, run_name, stage.key)
    work.mkdir(parents=True, exist_ok=True)
    splits: dict[str, SplitFiles] = {
        s: open_split(store, corpus.prefix, s, work / "corpus") for s in cfg.splits
    }
    if not any(sf.total_rows for sf in splits.values()):
        raise ExtractionError(f"the corpus at {corpus.prefix} has no rows in splits {cfg.splits}")
    servers = servers_of(cfg, slice_index)
    bounds = {
        s: slice_bounds(sf.total_rows, total_servers(cfg))[servers.start : servers.stop]
        for s, sf in splits.items()
    }
    tokens = _tokens_estimate(splits, bounds)
    progress_file = ProgressFile(store, stage.path(progress_key(slice_index, cfg.num_slices)))
    # Slices sharing a host (and its tmpfs) must not remove each other's dumps when they finish.
    dump_key = stage.key if slice_index is None else f"{stage.key}-slice{slice_index}"
    dumps = dump_root(cfg, run_name, dump_key, work, target.hidden_size, target.vocab_size)
    # What is already uploaded (resume) does not need disk again.
    report = disk.estimate(
        cfg,
        tokens=tokens,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        work_dir=work,
        store_dir=store.local_path(stage.prefix),
        already_uploaded_bytes=sum(s.bytes for s in progress_file.shards),
        dump_dir=dumps,
    )
    disk.check(report, cfg)
    return Plan(stage, work, dumps, splits, tokens, progress_file, report, servers, bounds)


def _tokens_estimate(splits: dict[str, SplitFiles], bounds: dict[str, list[tuple[int, int]]]) -> int:
    """Tokens in the planned row ranges: exact for the whole corpus, else pro rata by rows (the
    per-row counts would mean reading every token list; the preflight has its margin)."""
    total = 0
    for split, sf in splits.items():
        rows = sum(hi - lo for lo, hi in bounds[split])
        total += sf.tokens if rows == sf.total_rows else round(sf.tokens * rows / max(sf.total_rows, 1))
    return total


def run(
    cfg: ExtractConfig,
    *,
    store: ArtifactStore,
    run_name: str,
    target: TargetInfo,
    corpus: StageResult,
    server: ServerConfig,
    progress: ProgressFn = no_progress,
    rebuild_missing: bool = False,
) -> StageResult:
    """Extract the corpus's hidden states into shards, or return the cached result. A cached result
    whose shards are not all in the store is returned as it is unless `rebuild_missing`: then the
    missing shards are extracted again (the same bytes: shards depend only on the corpus order and
    the config) and the manifest is written anew. The pipeline asks for that only when a stage that
    reads the shards has to run (`aerie.pipeline.rebuild_missing`)."""
    check_server_quantization(cfg, server)
    stage = stage_dir(cfg, store, run_name, target, corpus, server)
    from aerie.extract import slices  # builds on this module

    missing = slices.forget_missing(stage, cfg.num_slices) if rebuild_missing else []
    if missing:
        log.warning(
            "extract %s: %d of its shards are not in the store (e.g. %s); extracting them again",
            stage.prefix,
            len(missing),
            missing[0],
        )
    cached = stage.cached_result()
    if cached is not None:
        progress(1.0, "cached")
        return cached
    if cfg.num_slices > 1:
        return slices.run_all_here(
            cfg,
            store=store,
            run_name=run_name,
            target=target,
            corpus=corpus,
            server=server,
            progress=progress,
        )
    began = time.monotonic()
    progress(0.0, "reading the corpus, disk preflight")
    p = plan(cfg, store=store, run_name=run_name, target=target, corpus=corpus, server=server)
    results, canary = extract(cfg, p, store=store, target=target, server=server, progress=progress)
    canary_record = canary.result.record() if canary.result is not None else None
    seconds = time.monotonic() - began
    manifest = manifest_body(
        cfg, target, corpus, server, p.splits, results, p.preflight.record(), canary_record, seconds
    )
    result = stage.finish(manifest)
    progress(1.0, f"{manifest['figures']['tokens']:,} tokens in {manifest['figures']['shards']} shards")
    return result


def extract(
    cfg: ExtractConfig,
    p: Plan,
    *,
    store: ArtifactStore,
    target: TargetInfo,
    server: ServerConfig,
    progress: ProgressFn = no_progress,
) -> tuple[list[SliceResult], ExtractionCanary]:
    """Run the planned servers (threads), upload their shards, tear everything down (always). One
    process at a time per slice on a host (`ExtractionError` naming the other's pid)."""
    with _slice_lock(p):
        # Read the resume state again under the lock: a process that held it may have closed shards
        # since this plan read it.
        p = replace(p, progress_file=ProgressFile(p.progress_file.store, p.progress_file.key))
        return _extract(cfg, p, store=store, target=target, server=server, progress=progress)


@contextlib.contextmanager
def _slice_lock(p: Plan) -> Iterator[None]:
    """A second process extracting these servers' rows would wipe their dump dirs as its servers start,
    and race them for the progress object: refuse it."""
    servers = f"s{p.servers.start}-s{p.servers.stop - 1}"
    lock = HostLock(p.work / f".lock-{servers}")
    try:
        lock.acquire()
    except HeldElsewhere as exc:
        raise ExtractionError(
            f"another process (pid {exc.holder}) is extracting {p.stage.prefix} with servers {servers} on "
            f"this host (lock {exc.path}); wait for it or stop it"
        ) from exc
    except OSError as exc:
        raise ExtractionError(f"cannot create the extraction lock in {p.work}: {exc}") from exc
    try:
        yield
    finally:
        lock.release()


def _extract(
    cfg: ExtractConfig,
    p: Plan,
    *,
    store: ArtifactStore,
    target: TargetInfo,
    server: ServerConfig,
    progress: ProgressFn,
) -> tuple[list[SliceResult], ExtractionCanary]:
    stage, work, splits, progress_file = p.stage, p.work, p.splits, p.progress_file
    canary = _make_canary(cfg, target, splits)
    uploader = Uploader(
        store,
        stage.prefix,
        progress_file,
        delete_local=cfg.delete_local_after_upload,
        max_pending=2 * len(p.servers),
        reread=cfg.reread_shards,
    )
    done_tokens = sum(s.tokens for s in progress_file.shards)
    meter = TokenMeter(p.tokens, done_tokens, progress)
    stop = threading.Event()

    def start_server(k: int, attempt: int) -> ModelServer:
        dump_dir = p.dumps / f"s{k}"
        spec = spec_for(
            _server_cfg(server, k, k - p.servers.start, len(p.servers)),
            model_path=target.path,
            mode="extract",
            name=f"extract-s{k}" + (f"-r{attempt}" if attempt else ""),
            dump_dir=dump_dir,
            clean_dump_dir=True,
            log_path=work / "logs" / f"server-s{k}-{attempt}.log",
            extra_args=_server_args(server, cfg),
            trust_remote_code=target.trust_remote_code,
        )
        dump_dir.mkdir(parents=True, exist_ok=True)

        def server_progress(fraction: float, message: str) -> None:
            progress(meter.done / meter.total, f"server s{k}: {message}")

        srv = ModelServer(spec, progress=server_progress, canary=canary)
        srv.start()
        return srv

    workers = [
        SliceWorker(
            k,
            cfg=cfg,
            splits=splits,
            bounds={s: b[i] for s, b in p.bounds.items()},
            prefix=stage.prefix,
            local_dir=work / "shards",
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            progress_file=progress_file,
            uploader=uploader,
            start_server=start_server,
            meter=meter,
            stop=stop,
            quantize_device=_quantize_device(cfg),
        )
        for i, k in enumerate(p.servers)
    ]
    failed = False
    try:
        results = _run_workers(workers, stop)
    except BaseException:
        failed = True
        raise
    finally:
        # Even on failure, let the closed shards finish uploading: the progress file then records
        # them and the re-run resumes after them.
        try:
            uploader.wait()
        except StoreError:
            if not failed:
                raise
            log.exception("a shard upload failed while the extraction was failing")
        finally:
            uploader.close()
            if p.dumps != work / "dumps":
                _remove_dump_root(p.dumps)  # tmpfs is memory
    meter.add(0, force=True)
    return results, canary


def _make_canary(cfg: ExtractConfig, target: TargetInfo, splits: dict[str, SplitFiles]) -> ExtractionCanary:
    first = next(sf for sf in splits.values() if sf.total_rows)
    rows = []
    for row in first.iter_rows(0, 64):
        rows.append(row)
    reference = cfg.canary_reference == "always" or (
        cfg.canary_reference == "auto" and fits_in_memory(target)
    )
    return ExtractionCanary(
        target, pick_sample(rows), reference=reference, rtol=cfg.canary_rtol, timeout_s=cfg.dump_timeout_s
    )


def _run_workers(workers: list[SliceWorker], stop: threading.Event) -> list[SliceResult]:
    """Run every slice in its own thread; the first failure stops the others (between batches) and
    is raised once all have torn their servers down."""
    if len(workers) == 1:
        return [workers[0].run()]
    errors: list[BaseException] = []

    def guarded(w: SliceWorker) -> SliceResult:
        try:
            return w.run()
        except BaseException as exc:
            errors.append(exc)
            stop.set()
            raise

    with ThreadPoolExecutor(max_workers=len(workers), thread_name_prefix="aerie-extract") as pool:
        futures = [pool.submit(guarded, w) for w in workers]
        for f in futures:
            f.exception()
    if errors:
        first = next((e for e in errors if "another slice failed" not in str(e)), errors[0])
        raise first
    return [f.result() for f in futures]


def _phases_by_slice(results: list[SliceResult]) -> dict[str, Any]:
    """With fan-out, every slice's phases (each over its own steady time), keyed s<k>."""
    if len(results) < 2:
        return {}
    return {
        "phases_by_slice": {
            f"s{r.slice}": r.phases.figures(r.pump_seconds) for r in results if r.pump_seconds > 0
        }
    }


def manifest_body(
    cfg: ExtractConfig,
    target: TargetInfo,
    corpus: StageResult,
    server: ServerConfig,
    splits: dict[str, SplitFiles],
    results: list[SliceResult],
    preflight_record: dict[str, Any],
    canary_record: dict[str, Any] | None,
    seconds: float,
) -> dict[str, Any]:
    """The stage manifest; refuses (`ExtractionError`) unless the shards hold exactly the corpus."""
    shards: list[ClosedShard] = sorted(
        (s for r in results for s in r.shards),
        key=lambda s: (cfg.splits.index(s.split), s.slice, s.index),  # type: ignore[arg-type]
    )
    per_split: dict[str, Any] = {}
    for split, sf in splits.items():
        mine = [s for s in shards if s.split == split]
        tokens = sum(s.tokens for s in mine)
        samples = sum(s.samples for s in mine)
        if tokens != sf.tokens or samples != sf.total_rows:
            raise ExtractionError(
                f"{split}: the shards hold {samples} samples / {tokens} tokens but the corpus has "
                f"{sf.total_rows} / {sf.tokens}: refusing to write a manifest over an incomplete extraction"
            )
        per_split[split] = {
            "samples": samples,
            "tokens": tokens,
            "shards": [s.record() for s in mine],
        }
    tokens = sum(s.tokens for s in shards)
    nbytes = sum(s.bytes for s in shards)
    fresh_tokens = sum(r.tokens for r in results)
    pump = max((r.pump_seconds for r in results), default=0.0)
    slowest = max(results, key=lambda r: r.pump_seconds, default=None)
    return {
        "target": {
            "name": target.name,
            "revision": target.revision,
            "architecture": target.architecture,
            "num_layers": target.num_layers,
            "hidden_size": target.hidden_size,
            "vocab_size": target.vocab_size,
        },
        "layers": {"input_of_layer": target.aux_layers_input, "output_of_layer": target.aux_layers_output},
        "storage_dtype": cfg.storage_dtype,
        "hidden_size": target.hidden_size,
        "shard_schema_version": SHARD_SCHEMA_VERSION,
        "corpus": {"prefix": corpus.prefix, "manifest_sha256": corpus.manifest_sha256},
        "server": {"backend": server.backend, "launcher": server.launcher, "num_servers": cfg.num_servers},
        "config": cfg.model_dump(mode="json"),
        "splits": per_split,
        "canary": canary_record,
        "preflight": preflight_record,
        "figures": {
            "samples": sum(s.samples for s in shards),
            "tokens": tokens,
            "shards": len(shards),
            "bytes": nbytes,
            "bytes_per_token": bytes_per_token(cfg.storage_dtype, target.hidden_size, target.vocab_size),
            "storage_dtype": cfg.storage_dtype,
            **{f"{split}_tokens": v["tokens"] for split, v in per_split.items()},
            "extracted_tokens_this_run": fresh_tokens,
            "resumed_rows": sum(r.resumed_rows for r in results),
            "tokens_per_s": round(fresh_tokens / seconds, 1) if seconds > 0 else None,
            # Without server starts and canaries: what the extraction itself sustains.
            "steady_tokens_per_s": round(fresh_tokens / pump, 1) if pump > 0 else None,
            # Share of the slowest slice's extraction time it waited on the commit path (see SliceResult).
            "commit_share": round(max(r.commit_seconds for r in results) / pump, 3) if pump > 0 else None,
            # Where the slowest slice's steady time went, client and server (aerie.extract.phases).
            "phases": slowest.phases.figures(pump) if slowest is not None and pump > 0 else None,
            **_phases_by_slice(results),
            "server_restarts": sum(r.restarts for r in results),
            "canary_passed": canary_record is not None or fresh_tokens == 0,
        },
    }
