"""Disk preflight: refuse, with the numbers, before launching anything.

An extraction can write hundreds of GB of hidden states (924 GB for 10K long samples). Here the bytes are
estimated up front from the corpus token count and the target's hidden size, and compared with the
free space of every filesystem the stage writes to: the local work dir (dumps in flight and shards
until uploaded) and, for a local artifact store, the store's filesystem (the uploaded shards).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aerie.diskspace import existing_parent
from aerie.errors import PreflightError
from aerie.extract.config import ExtractConfig
from aerie.shards.schema import bytes_per_token

# A dump holds input_ids int32 + aux [3H] + last [H] in the server's dtype (bf16: 2 bytes).
DUMP_ELEMENT_BYTES = 2


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} PB"


@dataclass
class Need:
    """Bytes one filesystem must hold."""

    path: str
    need: int
    free: int
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.free >= self.need


@dataclass
class PreflightReport:
    tokens: int
    bytes_per_token: int
    shard_bytes_total: int
    needs: list[Need]

    def record(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "bytes_per_token": self.bytes_per_token,
            "estimated_shard_bytes": self.shard_bytes_total,
            "filesystems": [
                {"path": n.path, "need": n.need, "free": n.free, "parts": n.parts} for n in self.needs
            ],
        }


def _device(path: Path) -> int:
    return os.stat(existing_parent(path)).st_dev


def dumps_in_flight_bytes(cfg: ExtractConfig, hidden_size: int, vocab_size: int | None = None) -> int:
    """Dump bytes the servers may hold at once, with the margin: every request in flight, the batch
    being handed over, the commit buffer, and the samples of the shards being filled, written and
    hashed (three). The client memory-maps the dumps (`aerie.tensorfile.load_mapped`) and a shard
    streams its samples from those mappings, so a dump's pages are freed only once its shard is written
    and hashed, not when the file is deleted."""
    per_token = 4 + (cfg.aux_layers + 1) * hidden_size * DUMP_ELEMENT_BYTES
    shard_tokens = cfg.shard_bytes // bytes_per_token(
        cfg.storage_dtype, hidden_size, vocab_size, cfg.aux_layers
    )
    tokens = (
        (cfg.requests_in_flight + 1) * cfg.batch_tokens
        + cfg.resolved_commit_buffer_tokens()
        + 3 * shard_tokens
    )
    return int(cfg.num_servers * tokens * per_token * cfg.disk_margin)


def estimate(
    cfg: ExtractConfig,
    *,
    tokens: int,
    hidden_size: int,
    vocab_size: int | None = None,
    work_dir: Path,
    store_dir: Path | None,
    already_uploaded_bytes: int = 0,
    dump_dir: Path | None = None,
) -> PreflightReport:
    """What the stage will write where (with `cfg.disk_margin`), and what is free there. `vocab_size`
    None counts int32 token ids (the larger of the two id widths a shard may use)."""
    bpt = bytes_per_token(cfg.storage_dtype, hidden_size, vocab_size, cfg.aux_layers)
    shards_total = int(tokens * bpt * cfg.disk_margin)
    remaining = max(0, shards_total - already_uploaded_bytes)
    dumps = dumps_in_flight_bytes(cfg, hidden_size, vocab_size)
    if cfg.delete_local_after_upload:
        # Per server: the shard being uploaded and the next one closing, written while it uploads.
        local_shards = min(remaining, 2 * cfg.num_servers * cfg.shard_bytes)
    else:
        local_shards = remaining
    by_dev: dict[int, Need] = {}

    def add(path: Path, part: str, n: int) -> None:
        dev = _device(path)
        need = by_dev.get(dev)
        if need is None:
            free = shutil.disk_usage(existing_parent(path)).free
            need = by_dev[dev] = Need(path=str(path), need=0, free=free)
        need.need += n
        need.parts[part] = need.parts.get(part, 0) + n

    add(dump_dir or work_dir, "dumps in flight", dumps)
    add(work_dir, "local shards", local_shards)
    if store_dir is not None:
        add(store_dir, "shards in the store", remaining)
    return PreflightReport(
        tokens=tokens, bytes_per_token=bpt, shard_bytes_total=shards_total, needs=list(by_dev.values())
    )


def check(report: PreflightReport, cfg: ExtractConfig) -> PreflightReport:
    """Raise `PreflightError` naming every filesystem that is short, and how to fix it."""
    short = [n for n in report.needs if not n.ok]
    if not short:
        return report
    lines = [
        f"not enough disk for extraction: {report.tokens:,} tokens x {report.bytes_per_token:,} B/token "
        f"({cfg.storage_dtype}) x margin {cfg.disk_margin} = {human_bytes(report.shard_bytes_total)} of shards"
    ]
    for n in short:
        parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in n.parts.items())
        lines.append(
            f"  {n.path}: needs {human_bytes(n.need)} ({parts}), only {human_bytes(n.free)} free "
            f"(short by {human_bytes(n.need - n.free)})"
        )
    hints = ["free space there", "or point extract.work_dir elsewhere"]
    if cfg.storage_dtype == "bf16":
        hints.append("or set extract.storage_dtype=fp8 (half the bytes)")
    if not cfg.delete_local_after_upload:
        hints.append("or set extract.delete_local_after_upload=true (keeps ~2 shards per server locally)")
    lines.append("fix: " + ", ".join(hints))
    raise PreflightError("\n".join(lines))
