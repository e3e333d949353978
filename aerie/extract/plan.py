"""Everything an extraction decides before a server is launched: its stage key (`extract_key`, which the
stage turns into the StageDir it hands the work), the work and dump dirs, which servers this host runs and their row ranges, the token count and the
disk preflight (`PreflightError` before anything starts).

The stage key covers what changes the shards' contents or layout (storage dtype, shard size, server
count over all slices, splits, the captured layers when they are not EAGLE-3's), the server backend, the target and its revision and the corpus manifest
digest; operational knobs (batch size, requests in flight, restarts, timeouts, work dir, commit workers and buffer,
and where fp8 is quantized: `quantize_device`, `quantize_on_server`, one function on identical inputs,
byte-identical shards) are left out, so changing them does not throw away uploaded shards on a re-run.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from aerie.errors import ConfigError, ExtractionError
from aerie.extract import preflight as disk
from aerie.extract.config import ExtractConfig, server_quantization_problem
from aerie.extract.corpus_rows import SplitFiles, open_split, slice_bounds
from aerie.extract.resume import ProgressFile, progress_key
from aerie.manifest import StageDir, StageResult, stage_key
from aerie.serving import ServerConfig
from aerie.settings import cache_path
from aerie.shards.schema import SHARD_SCHEMA_VERSION
from aerie.stage import WorkContext
from aerie.targets import TargetInfo

STAGE = "extract"
SHM_DUMPS = Path("/dev/shm/aerie-extract")
KEY_FIELDS = ("storage_dtype", "shard_bytes", "num_servers", "splits")


def extract_key(cfg: ExtractConfig, server: ServerConfig, target: TargetInfo, corpus: StageResult) -> str:
    extract = cfg.model_dump(mode="json", include=set(KEY_FIELDS))
    # The shard layout is decided by the number of contiguous ranges, not by how many hosts run them:
    # 2 hosts x 1 server write exactly the shards of 1 host x 2 servers (and a 1-slice key is unchanged).
    extract["num_servers"] = total_servers(cfg)
    config: dict[str, object] = {
        "extract": extract,
        # A new shard layout is a new extraction: a resume never mixes shards of two schemas.
        "shard_schema_version": SHARD_SCHEMA_VERSION,
        "server_backend": server.backend,
        "target": target.name,
        "target_revision": target.revision,
    }
    layers = cfg.layers_output(target)
    if layers != target.aux_layers_output:  # other layers than EAGLE-3's: other shards (its keys stay)
        config["capture_layers"] = layers
    return stage_key(STAGE, config, [corpus.manifest_sha256])


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
    return cache_path("extract") / run_name / key


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


def check_server_quantization(cfg: ExtractConfig, server: ServerConfig) -> None:
    """`ConfigError` where `quantize_on_server` cannot run (`server_quantization_problem`): the configs
    refuse it at load, but a `model_copy` skips validation."""
    problem = server_quantization_problem(cfg, server.backend)
    if problem:
        raise ConfigError(problem)


@dataclass
class Plan:
    """Everything decided before a server is launched."""

    stage_dir: StageDir
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
    ctx: WorkContext,
    *,
    corpus: StageResult,
    server: ServerConfig,
    slice_index: int | None = None,
) -> Plan:
    """Read the corpus counts and the resume state, and run the disk preflight (`PreflightError`), for
    the extraction writing to `ctx.stage_dir` (its StageDir, keyed by `extract_key`). `slice_index` plans one
    slice of a multi-host run (its own progress object and dump root)."""
    check_server_quantization(cfg, server)
    stage_dir, target = ctx.stage_dir, ctx.target
    store, run_name = stage_dir.store, stage_dir.run
    work = work_dir(cfg, run_name, stage_dir.key)
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
    progress_file = ProgressFile(store, stage_dir.path(progress_key(slice_index, cfg.num_slices)))
    # Slices sharing a host (and its tmpfs) must not remove each other's dumps when they finish.
    dump_key = stage_dir.key if slice_index is None else f"{stage_dir.key}-slice{slice_index}"
    dumps = dump_root(cfg, run_name, dump_key, work, target.geometry.hidden_size, target.geometry.vocab_size)
    # What is already uploaded (resume) does not need disk again.
    report = disk.estimate(
        cfg,
        tokens=tokens,
        hidden_size=target.geometry.hidden_size,
        vocab_size=target.geometry.vocab_size,
        work_dir=work,
        store_dir=store.local_path(stage_dir.prefix),
        already_uploaded_bytes=sum(s.bytes for s in progress_file.shards),
        dump_dir=dumps,
    )
    disk.check(report, cfg)
    return Plan(stage_dir, work, dumps, splits, tokens, progress_file, report, servers, bounds)


def _tokens_estimate(splits: dict[str, SplitFiles], bounds: dict[str, list[tuple[int, int]]]) -> int:
    """Tokens in the planned row ranges: exact for the whole corpus, else pro rata by rows (the
    per-row counts would mean reading every token list; the preflight has its margin)."""
    total = 0
    for split, sf in splits.items():
        rows = sum(hi - lo for lo, hi in bounds[split])
        total += sf.tokens if rows == sf.total_rows else round(sf.tokens * rows / max(sf.total_rows, 1))
    return total
