"""Running the planned servers of one host (`aerie.extract.plan.Plan`): one thread per server (its
`SliceWorker`: launch, canary, batches, shards, restarts), the shards uploaded in the background, and
everything torn down whatever happens. One process at a time extracts a host's slice (`HostLock`)."""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from aerie.errors import ExtractionError, StoreError
from aerie.extract.canary import ExtractionCanary, fits_in_memory, pick_sample
from aerie.extract.config import ExtractConfig
from aerie.extract.corpus_rows import SplitFiles
from aerie.extract.plan import SHM_DUMPS, Plan
from aerie.extract.resume import ProgressFile
from aerie.extract.uploads import Uploader
from aerie.extract.worker import SliceResult, SliceWorker, TokenMeter
from aerie.hostlock import held
from aerie.progress import ProgressFn, no_progress
from aerie.serving import ModelServer, ServerConfig, ServerSpec, spec_for
from aerie.sglang_plugin.capture import AUX_LAYERS_ENV
from aerie.store import ArtifactStore
from aerie.targets import TargetInfo

log = logging.getLogger(__name__)


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


def _slice_lock(p: Plan) -> contextlib.AbstractContextManager[None]:
    """A second process extracting these servers' rows would wipe their dump dirs as its servers start,
    and race them for the progress object: refuse it."""
    servers = f"s{p.servers.start}-s{p.servers.stop - 1}"
    return held(
        p.work / f".lock-{servers}",
        ExtractionError,
        f"extracting {p.stage_dir.prefix} with servers {servers} on this host",
        f"the extraction lock in {p.work}",
    )


def _extract(
    cfg: ExtractConfig,
    p: Plan,
    *,
    store: ArtifactStore,
    target: TargetInfo,
    server: ServerConfig,
    progress: ProgressFn,
) -> tuple[list[SliceResult], ExtractionCanary]:
    stage_dir, work, splits, progress_file = p.stage_dir, p.work, p.splits, p.progress_file
    canary = make_canary(cfg, target, splits)
    uploader = Uploader(
        store,
        stage_dir.prefix,
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
        spec = server_spec(
            cfg,
            server,
            target,
            index=k,
            local=k - p.servers.start,
            num_local=len(p.servers),
            attempt=attempt,
            dump_dir=dump_dir,
            log_dir=work / "logs",
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
            prefix=stage_dir.prefix,
            local_dir=work / "shards",
            hidden_size=target.geometry.hidden_size,
            vocab_size=target.geometry.vocab_size,
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


def make_canary(cfg: ExtractConfig, target: TargetInfo, splits: dict[str, SplitFiles]) -> ExtractionCanary:
    first = next(sf for sf in splits.values() if sf.total_rows)
    rows = []
    for row in first.iter_rows(0, 64):
        rows.append(row)
    reference = cfg.canary_reference == "always" or (
        cfg.canary_reference == "auto" and fits_in_memory(target)
    )
    return ExtractionCanary(
        target,
        pick_sample(rows),
        reference=reference,
        rtol=cfg.canary_rtol,
        timeout_s=cfg.dump_timeout_s,
        layers=cfg.layers_input(target),
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


def server_spec(
    cfg: ExtractConfig,
    server: ServerConfig,
    target: TargetInfo,
    *,
    index: int,
    local: int,
    num_local: int,
    attempt: int,
    dump_dir: Path,
    log_dir: Path,
) -> ServerSpec:
    """The launch of extraction server `index` (global; `local` of `num_local` on this host), for its
    `attempt`-th start: its port and GPU group, the backend's extraction flags and the stage's own."""
    return spec_for(
        _server_cfg(server, index, local, num_local),
        model_path=target.path,
        mode="extract",
        name=f"extract-s{index}" + (f"-r{attempt}" if attempt else ""),
        dump_dir=dump_dir,
        clean_dump_dir=True,
        log_path=log_dir / f"server-s{index}-{attempt}.log",
        extra_args=_server_args(server, cfg, target),
        env=_server_env(server, cfg, target),
        trust_remote_code=target.trust_remote_code,
    )


def _server_args(server: ServerConfig, cfg: ExtractConfig, target: TargetInfo) -> list[str]:
    """Flags the stage adds to the reference server's command line (none for SGLang).

    One request, one packed forward: the reference server packs waiting sequences up to its
    `--max-batch-tokens` (16,384 by default), which split the preset's 65,536-token requests into four
    smaller forwards (on the H200: 489K tokens/s at 16K-token packs, 613K at 64K). A value the server
    config already sets is kept. With `quantize_on_server`, `--dump-dtype fp8`: the server quantizes
    each pack on its device and the dumps hold the shards' fp8 codes and scales. Layers other than
    EAGLE-3's (a DFlash drafter's): `--aux-layers`, in the server's input-of-layer convention."""
    if server.backend != "reference":
        return []
    args = [] if "--max-batch-tokens" in server.extra_args else ["--max-batch-tokens", str(cfg.batch_tokens)]
    if cfg.layers_output(target) != target.aux_layers_output:
        args += ["--aux-layers", *map(str, cfg.layers_input(target))]
    if cfg.quantize_on_server and cfg.storage_dtype == "fp8":
        args += ["--dump-dtype", "fp8"]
    return args


def _server_env(server: ServerConfig, cfg: ExtractConfig, target: TargetInfo) -> dict[str, str]:
    """SGLang's dump plugin reads layers other than EAGLE-3's from its environment (output-of-layer
    ids, the convention of `set_eagle3_layers_to_capture`)."""
    if server.backend == "reference" or cfg.layers_output(target) == target.aux_layers_output:
        return {}
    return {AUX_LAYERS_ENV: ",".join(map(str, cfg.layers_output(target)))}


def _server_cfg(server: ServerConfig, index: int, local: int, num_local: int) -> ServerConfig:
    """Server `index` (global) of a fan-out: its own port (by global index, so slices sharing a host
    never collide) and, when one host runs several, its own GPU group (by its index on this host)."""
    env = dict(server.env)
    if num_local > 1 and server.device != "cpu" and "CUDA_VISIBLE_DEVICES" not in env:
        first = local * server.tp_size
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(server.tp_size))
    return server.model_copy(update={"port": server.port + index, "env": env})


def _quantize_device(cfg: ExtractConfig) -> str:
    # auto = cpu: the commit pool's threads scale with the cores, while per-sample GPU quantization
    # (what auto meant before) waits on transfers and on the server's forward passes sharing the GPU.
    return "cpu" if cfg.quantize_device == "auto" else cfg.quantize_device


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
