"""Shared fixtures for the draft/train tests: a tiny real Llama target and hidden-state shards made by
running it (greedy continuations of random prompts, captured the way the extract stage captures them),
written with the extract stage's own ShardWriter, plus upstream stage manifests in a LocalStore."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from aerie.manifest import StageDir, StageResult
from aerie.shards.format import HiddenSample
from aerie.shards.writer import ShardWriter
from aerie.store import ArtifactStore, LocalStore
from aerie.targets import TargetInfo, resolve_target

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 8,
    "vocab_size": 256,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def tiny_target(root: Path, seed: int = 0) -> tuple[TargetInfo, LlamaForCausalLM]:
    """A random 8-layer Llama (hidden 64, vocab 256) saved as an HF dir, resolved like any local target."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    with torch.no_grad():  # a freshly initialised head is near-uniform; a trained target is peaked
        model.lm_head.weight.mul_(40.0)
    path = root / "tiny-llama"
    model.save_pretrained(path)
    return resolve_target(str(path), cache_dir=root / "cache"), model


@torch.no_grad()
def make_samples(
    model: LlamaForCausalLM,
    target: TargetInfo,
    n: int,
    prompt: int,
    response: int,
    seed: int = 0,
    layers: list[int] | None = None,
) -> list[HiddenSample]:
    """Random prompts + the target's greedy continuation; loss_mask marks the continuation. The captured
    layers are `layers` (output-of-layer ids, a family's), EAGLE-3's by default."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        ids = torch.randint(0, target.geometry.vocab_size, (1, prompt), generator=g)
        for _ in range(response):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        out = model(ids, output_hidden_states=True)
        hs = out.hidden_states  # hs[i] enters layer i; hs[-1] is after the final norm
        aux = torch.cat([hs[i + 1][0] for i in (layers or target.aux_layers_output)], dim=-1)
        mask = torch.zeros(ids.shape[1], dtype=torch.bool)
        mask[prompt:] = True
        samples.append(HiddenSample(f"s{seed}-{i}", ids[0], mask, aux, hs[-1][0]))
    return samples


def write_shards(
    samples: list[HiddenSample], out: Path, storage: str = "bf16", shard_bytes: int = 1 << 20
) -> list[Path]:
    hidden = samples[0].last_hidden.shape[1]
    writer = ShardWriter(
        out,
        storage=storage,  # type: ignore[arg-type]
        shard_bytes=shard_bytes,
        hidden_size=hidden,
        aux_layers=samples[0].aux_hidden.shape[1] // hidden,
    )
    infos = [info for s in samples if (info := writer.add(s)) is not None]
    last = writer.close()
    if last is not None:
        infos.append(last)
    return [i.path for i in infos]


@dataclass
class Upstream:
    store: ArtifactStore
    target: TargetInfo
    shards: StageResult
    corpus: StageResult


def make_upstream(
    root: Path,
    target: TargetInfo,
    train: list[HiddenSample],
    held: list[HiddenSample],
    storage: str = "bf16",
    store: ArtifactStore | None = None,
    layers: list[int] | None = None,
) -> Upstream:
    """Extract and corpus stage outputs in a store (default: a LocalStore under `root`), finished through
    StageDir like real stages; the shards hold `layers` (EAGLE-3's by default, as `make_samples`)."""
    store = store or LocalStore(root / "artifacts")
    ex = StageDir(store, "t", "extract", "k-extract")
    splits = {}
    for split, samples in (("train", train), ("eval", held)):
        records = []
        for path in write_shards(samples, root / "shards" / split, storage) if samples else []:
            info = store.put_file(ex.path(f"shards/{split}/{path.name}"), path)
            records.append({"name": path.name, "path": f"shards/{split}/{path.name}", "sha256": info.sha256})
        splits[split] = {"shards": records}
    shards = ex.finish(
        {
            "splits": splits,
            "hidden_size": target.geometry.hidden_size,
            "storage_dtype": storage,
            "layers": {
                "output_of_layer": layers or target.aux_layers_output,
                "input_of_layer": [i + 1 for i in layers or target.aux_layers_output],
            },
        }
    )
    corpus_dir = StageDir(store, "t", "corpus", "k-corpus")
    counts = torch.zeros(target.geometry.vocab_size, dtype=torch.int64)
    for s in train:
        counts += torch.bincount(s.input_ids[s.loss_mask], minlength=target.geometry.vocab_size)
    frame = pl.DataFrame(
        {
            "token_id": torch.arange(target.geometry.vocab_size).numpy().astype("int32"),
            "count": counts.numpy(),
        }
    )
    path = root / "token_counts.parquet"
    frame.write_parquet(path)
    store.put_file(corpus_dir.path("token_counts.parquet"), path)
    corpus = corpus_dir.finish({"files": {"token_counts": "token_counts.parquet"}})
    return Upstream(store, target, shards, corpus)
