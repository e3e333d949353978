"""Offline or online training, by the plan's numbers: shard bytes (disk, S3) against the GPU time of
extracting again every epoch.

Offline extracts the corpus once into shards, then trains on them: its price is the shards' bytes,
locally while they are written and in the store. Online (extraction servers feeding the trainer) keeps extraction
servers running beside the trainer and extracts each epoch's samples again, plus the held-out split at
every evaluation: no shard bytes, but the servers' GPUs are held for the whole training, and the run
lasts as long as the slower of the trainer and its servers.

The recommendation:

- online when a disk cannot hold the shards (a location that is short with them and fits without);
- online when it costs at most `ONLINE_EXTRA_SHARE` more GPU time than offline (about one epoch:
  the same extraction, nothing stored);
- shards otherwise, with the GPU-hours online would add and the bytes it would save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from aerie.plan import disk, sizes, throughput

if TYPE_CHECKING:
    from aerie.config import PipelineConfig
    from aerie.plan.facts import TargetFacts


class Planned(Protocol):
    """What the comparison reads of a plan (`aerie.plan.plan.Plan` has it; that module imports this one)."""

    @property
    def cfg(self) -> PipelineConfig: ...

    @property
    def target(self) -> TargetFacts: ...

    @property
    def sizes(self) -> sizes.Sizes: ...

    @property
    def stages(self) -> list[throughput.StageEstimate]: ...

    @property
    def disk(self) -> disk.DiskPlan: ...


Source = Literal["shards", "online"]
# Online wins a tie: within this share of offline's GPU time it costs about the same and stores nothing.
ONLINE_EXTRA_SHARE = 0.10
SHARD_PARTS = ("local shards", "shards")


@dataclass(frozen=True)
class SourceComparison:
    """Offline against online for one config (seconds and bytes; GPU time as GPU-seconds)."""

    shard_bytes: int  # what offline writes to the store (S3 or a local dir)
    s3_bytes: int  # of them, to S3
    short: list[str]  # locations that cannot hold the shards (and could without them)
    offline_gpu_s: float  # extraction once, then training
    offline_s: float
    online_gpu_s: float  # trainer and servers side by side, for the slower of the two
    online_s: float
    online_extract_tokens: int  # every epoch's train samples plus every evaluation's held-out ones
    extractions: float  # online_extract_tokens over the corpus's tokens
    unit: str  # what the costs count: GPU-hours, or a CPU machine's hours
    offline_cost: float  # seconds of `unit`
    online_cost: float
    choice: Source
    reason: str

    def record(self) -> dict[str, Any]:
        return {
            "shard_bytes": self.shard_bytes,
            "s3_bytes": self.s3_bytes,
            "short": self.short,
            "unit": self.unit,
            "offline_cost_s": round(self.offline_cost, 1),
            "online_cost_s": round(self.online_cost, 1),
            "offline": {"gpu_seconds": round(self.offline_gpu_s, 1), "seconds": round(self.offline_s, 1)},
            "online": {
                "gpu_seconds": round(self.online_gpu_s, 1),
                "seconds": round(self.online_s, 1),
                "extracted_tokens": self.online_extract_tokens,
                "extractions": round(self.extractions, 2),
            },
            "recommended": self.choice,
            "reason": self.reason,
        }


def compare(
    cfg: PipelineConfig,
    size: sizes.Sizes,
    stages: list[throughput.StageEstimate],
    disk_plan: disk.DiskPlan,
) -> SourceComparison:
    """The comparison from a plan's parts (its sizes, stage estimates and disk)."""
    by_stage = {s.stage: s for s in stages}
    extract, train = by_stage["extract"], by_stage["train"]
    online_tokens = size.train_tokens + evaluations(cfg, size) * eval_tokens_each(cfg, size)
    extractions = online_tokens / max(1, size.corpus_tokens)
    online_extract_s = extract.seconds * extractions
    online_s = max(train.seconds, online_extract_s)
    server_gpus = extract.gpus
    offline_gpu_s = extract.gpu_seconds + train.gpu_seconds
    online_gpu_s = (train.gpus + server_gpus) * online_s
    # On a machine without GPUs (the embedded default) its time is the cost: the stages run one at a time.
    on_gpu = extract.gpus > 0 or train.gpus > 0
    offline_cost = offline_gpu_s if on_gpu else extract.seconds + train.seconds
    online_cost = online_gpu_s if on_gpu else online_s
    unit = "GPU-hours" if on_gpu else "hours of this machine"
    short = short_for_shards(disk_plan)
    remote = cfg.store.uri.startswith("s3://")
    fields: dict[str, Any] = {
        "shard_bytes": disk_plan.shard_bytes,
        "s3_bytes": disk_plan.shard_bytes if remote else 0,
        "short": short,
        "offline_gpu_s": offline_gpu_s,
        "offline_s": extract.seconds + train.seconds,
        "online_gpu_s": online_gpu_s,
        "online_s": online_s,
        "online_extract_tokens": online_tokens,
        "extractions": extractions,
        "unit": unit,
        "offline_cost": offline_cost,
        "online_cost": online_cost,
    }
    where = "S3" if remote else cfg.store.uri
    saved = f"{_bytes(disk_plan.shard_bytes)} of shards in {where}"
    extra = online_cost - offline_cost
    if short:
        choice: Source = "online"
        reason = f"{', '.join(short)} cannot hold the shards; online writes none"
    elif extra <= ONLINE_EXTRA_SHARE * offline_cost:
        choice = "online"
        reason = (
            f"online extracts {extractions:.1f}x the corpus for {_more(extra)} {unit} "
            f"(within {ONLINE_EXTRA_SHARE:.0%}) and stores nothing: saves {saved}"
        )
    else:
        choice = "shards"
        reason = (
            f"online would extract {extractions:.1f}x the corpus, {_hours(extra)} more {unit}, "
            f"to save {saved}"
        )
    return SourceComparison(**fields, choice=choice, reason=reason)


def evaluations(cfg: PipelineConfig, size: sizes.Sizes) -> int:
    """Held-out evaluations a training makes: every `eval_every` steps and at the last."""
    t = cfg.train
    steps = max(1, math.floor(size.train_tokens / t.batch_tokens / t.num_gpus))
    return steps // t.eval_every + (0 if steps % t.eval_every == 0 else 1)


def eval_tokens_each(cfg: PipelineConfig, size: sizes.Sizes) -> int:
    """Held-out tokens one evaluation extracts online (capped by `eval_max_batches`)."""
    cap = cfg.train.eval_max_batches
    return size.eval_tokens if cap is None else min(size.eval_tokens, cap * cfg.train.batch_tokens)


def short_for_shards(plan: disk.DiskPlan) -> list[str]:
    """Locations short with the shards that would hold the run without them."""
    out = []
    for loc in plan.locations:
        shards = sum(loc.parts.get(p, 0) for p in SHARD_PARTS)
        if loc.short and shards and loc.free is not None and loc.need - shards <= loc.free:
            out.append(loc.name)
    return out


def of_plan(plan: Planned) -> SourceComparison:
    """The comparison for the plan's config. An online config's plan holds no shards: offline's side is
    planned for the same config on shards."""
    offline_disk = plan.disk
    if plan.cfg.train.source == "online":
        cfg = plan.cfg.model_copy(update={"train": plan.cfg.train.model_copy(update={"source": "shards"})})
        offline_disk = disk.estimate(cfg, plan.target, plan.sizes)
    return compare(plan.cfg, plan.sizes, plan.stages, offline_disk)


def lines(plan: Planned) -> list[str]:
    """The comparison as `aerie plan` prints it."""
    c = of_plan(plan)
    s3 = f" ({_bytes(c.s3_bytes)} to S3)" if c.s3_bytes else ""
    return [
        "",
        "offline (extract to shards, then train) or online (servers feed the trainer, no shards)",
        f"  offline: {_bytes(c.shard_bytes)} of shards{s3}; {_hours(c.offline_cost)} {c.unit} "
        f"(extract once, then train: {_hours(c.offline_s)} h)",
        f"  online:  no shards; {_hours(c.online_cost)} {c.unit} (trainer and servers side by side for "
        f"{_hours(c.online_s)} h, {c.extractions:.1f}x the corpus extracted: "
        f"{c.online_extract_tokens:,} tokens)",
        f"  recommended: {c.choice}: {c.reason}",
    ]


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.1f}" if seconds >= 360 else f"{seconds / 3600:,.3f}"


def _more(seconds: float) -> str:
    return f"{_hours(seconds)} more" if seconds >= 0 else f"{_hours(-seconds)} less"


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:.0f} B"
