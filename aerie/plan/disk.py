"""Bytes per location: the tmpfs dumps in flight, the local shards, the checkpoints and everything else
in the store, against the free space of each local filesystem; S3 bytes and requests for a remote store.
The shard and dump sizes follow `aerie.shards.schema` and `aerie.extract.preflight` (the same formulas
without importing torch; tests/test_plan.py checks they agree)."""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from aerie.config import PipelineConfig
from aerie.diskspace import existing_parent
from aerie.families import family_of
from aerie.plan.facts import TargetFacts
from aerie.plan.sizes import Sizes

DUMP_ELEMENT_BYTES = 2  # a dump holds aux [kH] + last [H] in the server's dtype (bf16)
SHM = Path("/dev/shm")
# The corpus's Parquet rows: int32 ids and a mask byte per token, about halved by compression; the
# generation's conversations: the text, about 4 bytes per token.
CORPUS_BYTES_PER_TOKEN = 2.5
TEXT_BYTES_PER_TOKEN = 4.0
MIB = 1 << 20


def aux_layers(cfg: PipelineConfig, target: TargetFacts) -> int:
    """Layers a token's captured states hold: `extract.capture_layers`, else what `train.drafter`'s
    family reads (EAGLE-3: 3; DFlash: `train.drafter.num_target_layers`)."""
    if cfg.extract.capture_layers is not None:
        return len(cfg.extract.capture_layers)
    return len(cfg.train.capture_layers(target.geometry.num_layers))


def shard_bytes_per_token(storage: str, hidden_size: int, vocab_size: int | None, layers: int = 3) -> int:
    """`aerie.shards.schema.bytes_per_token`: `layers` captured states and the last one, ids (uint16
    when the vocabulary fits) and a mask."""
    ids_and_mask = (2 if vocab_size is not None and vocab_size <= 1 << 16 else 4) + 1
    rows = layers + 1
    if storage == "bf16":
        return rows * hidden_size * 2 + ids_and_mask
    return rows * hidden_size + rows + ids_and_mask  # fp8 and one E8M0 scale byte per row


def dumps_in_flight_bytes(cfg: PipelineConfig, target: TargetFacts) -> int:
    """`aerie.extract.preflight.dumps_in_flight_bytes`: every request in flight, the batch being handed
    over, the commit buffer and three shards' samples, with the margin."""
    ex = cfg.extract
    layers = aux_layers(cfg, target)
    per_token = 4 + (layers + 1) * target.geometry.hidden_size * DUMP_ELEMENT_BYTES
    shard_tokens = ex.shard_bytes // shard_bytes_per_token(
        ex.storage_dtype, target.geometry.hidden_size, target.geometry.vocab_size, layers
    )
    tokens = (
        (ex.requests_in_flight + 1) * ex.batch_tokens + ex.resolved_commit_buffer_tokens() + 3 * shard_tokens
    )
    return int(ex.num_servers * tokens * per_token * ex.disk_margin)


def drafter_params(cfg: PipelineConfig, target: TargetFacts) -> int:
    """Trainable drafter parameters, as `train.drafter`'s family counts them (`Family.draft_params`)."""
    return family_of(cfg.train.drafter).draft_params(cfg.train.drafter, cfg.train, target.geometry)


@dataclass
class Location:
    """What one place holds at its fullest."""

    name: str
    path: str | None  # None: not on this machine (S3)
    need: int
    free: int | None = None
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def short(self) -> bool:
        return self.free is not None and self.need > self.free


@dataclass
class DiskPlan:
    locations: list[Location]
    s3_bytes: int
    s3_requests: int
    shard_bytes: int  # the shards this run writes: none online


def _free(path: Path) -> tuple[int, int] | None:
    """(device, free bytes) of the filesystem that holds `path`, or None when it cannot be measured."""
    try:
        where = existing_parent(path)
        return os.stat(where).st_dev, shutil.disk_usage(where).free
    except OSError:
        return None


def estimate(cfg: PipelineConfig, target: TargetFacts, sizes: Sizes) -> DiskPlan:
    """Online (`train.source: online`) no shard is written, locally or to the store: the servers' dumps in
    flight and the optional sample cache (`train.online.cache_bytes`) take their place. `auto` is
    planned with the shards (`aerie.plan.plan` forgives a disk short only by them, as auto goes online)."""
    from aerie.settings import get_settings

    ex = cfg.extract
    online = cfg.train.source == "online"
    bpt = shard_bytes_per_token(
        ex.storage_dtype, target.geometry.hidden_size, target.geometry.vocab_size, aux_layers(cfg, target)
    )
    shards = 0 if online else int(sizes.corpus_tokens * bpt)
    dumps = dumps_in_flight_bytes(cfg, target)
    local_shards = (
        min(shards, 2 * ex.num_servers * ex.shard_bytes) if ex.delete_local_after_upload else shards
    )
    params = drafter_params(cfg, target)
    # fp32 weights and AdamW's two moments per kept checkpoint, the best one's weights, the bf16 export.
    checkpoints = cfg.train.keep_checkpoints * 12 * params + 4 * params
    drafter = 2 * params
    store_parts = {
        "generated conversations": int(
            TEXT_BYTES_PER_TOKEN * (sizes.prompt_tokens + sizes.completion_tokens) / 4
        ),
        "corpus": int(CORPUS_BYTES_PER_TOKEN * sizes.corpus_tokens),
        "shards": shards,
        "checkpoints": checkpoints,
        "drafter": drafter,
    }
    work = Path(ex.work_dir).expanduser() if ex.work_dir else get_settings().cache_dir / "extract"
    dump_dir = Path(ex.dump_dir).expanduser() if ex.dump_dir else None
    if dump_dir is None:
        shm = _free(SHM)
        dump_dir = SHM if shm is not None and shm[1] >= dumps else work / "dumps"
    wanted: list[tuple[str, Path | None, str, int]] = [
        ("dumps in flight", dump_dir, str(dump_dir), dumps),
        ("local shards", work, str(work), local_shards),
    ]
    if online and cfg.train.online.cache_bytes:
        train_cache = (
            Path(cfg.train.cache_dir).expanduser()
            if cfg.train.cache_dir
            else get_settings().cache_dir / "train"
        )
        wanted.append(("online sample cache", train_cache, str(train_cache), cfg.train.online.cache_bytes))
    remote = cfg.store.uri.startswith("s3://")
    for part, n in store_parts.items():
        wanted.append((part, None if remote else Path(cfg.store.uri).expanduser(), cfg.store.uri, n))
    by_place: dict[object, Location] = {}
    for part, path, label, n in wanted:
        measured = _free(path) if path is not None else None
        key: object = measured[0] if measured is not None else label
        loc = by_place.get(key)
        if loc is None:
            loc = by_place[key] = Location(
                name=label, path=str(path) if path else None, need=0, free=measured[1] if measured else None
            )
        if label not in loc.name.split(" + "):
            loc.name = f"{loc.name} + {label}"
        loc.need += n
        loc.parts[part] = loc.parts.get(part, 0) + n
    s3_bytes = sum(store_parts.values()) if remote else 0
    chunk = cfg.store.multipart_chunk_mb * MIB
    # A multipart object: create, its parts, complete, and a read-back check; a small one: a PUT and a check.
    objects = math.ceil(shards / ex.shard_bytes) if shards else 0
    requests = objects * (math.ceil(ex.shard_bytes / chunk) + 3)
    requests += 2 * (cfg.train.keep_checkpoints + 1) * math.ceil(12 * params / chunk + 3) + 200
    return DiskPlan(list(by_place.values()), s3_bytes, requests if remote else 0, shards)
