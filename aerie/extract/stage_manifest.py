"""The extract stage's manifest: what the shards hold, per split, checked against the corpus (a
manifest is never written over an incomplete extraction), and the figures of the run that made them."""

from __future__ import annotations

from typing import Any

from aerie.errors import ExtractionError
from aerie.extract.config import ExtractConfig
from aerie.extract.corpus_rows import SplitFiles
from aerie.extract.resume import ClosedShard
from aerie.extract.worker import SliceResult
from aerie.manifest import StageResult
from aerie.serving import ServerConfig
from aerie.shards.schema import SHARD_SCHEMA_VERSION, bytes_per_token
from aerie.targets import TargetInfo


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
            "architecture": target.geometry.architecture,
            "num_layers": target.geometry.num_layers,
            "hidden_size": target.geometry.hidden_size,
            "vocab_size": target.geometry.vocab_size,
        },
        "layers": {"input_of_layer": cfg.layers_input(target), "output_of_layer": cfg.layers_output(target)},
        "storage_dtype": cfg.storage_dtype,
        "hidden_size": target.geometry.hidden_size,
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
            "bytes_per_token": bytes_per_token(
                cfg.storage_dtype, target.geometry.hidden_size, target.geometry.vocab_size, cfg.aux_layers
            ),
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


def _phases_by_slice(results: list[SliceResult]) -> dict[str, Any]:
    """With fan-out, every slice's phases (each over its own steady time), keyed s<k>."""
    if len(results) < 2:
        return {}
    return {
        "phases_by_slice": {
            f"s{r.slice}": r.phases.figures(r.pump_seconds) for r in results if r.pump_seconds > 0
        }
    }
