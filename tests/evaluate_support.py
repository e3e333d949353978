"""Upstream stage results for the evaluation and deployment tests, built with the real producers: a
corpus merged by the corpus stage from a few ShareGPT conversations, and a train-stage result holding
an (untrained) drafter written by the drafter exporter."""

from __future__ import annotations

import torch

from aerie.corpus import import_conversations
from aerie.corpus import work as corpus_work
from aerie.corpus.config import CorpusConfig
from aerie.datasets import SourceSpec, iter_conversations
from aerie.draft.export import draft_config_for, export_drafter
from aerie.draft.model import Eagle3Drafter
from aerie.draft.target_weights import load_embedding
from aerie.draft.vocab import build_vocab_map, load_token_counts
from aerie.manifest import StageDir, StageResult
from aerie.store import ArtifactStore
from aerie.targets import TargetInfo
from tests.stage_work import staged

merge = staged("merge", corpus_work.run)


def corpus_result(store: ArtifactStore, run: str, target: TargetInfo, n: int = 12) -> StageResult:
    raw = import_conversations(
        iter_conversations(SourceSpec(kind="sharegpt"), "sharegpt", limit=n),
        store=store,
        run_name=run,
        name="sg",
    )
    cfg = CorpusConfig(eval_fraction=0.5, num_workers=1, max_length=256)
    return merge(cfg, store=store, run_name=run, target=target, inputs=[raw])


def random_drafter(target: TargetInfo, vocab: int = 512, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(draft_config_for(target, vocab), load_embedding(target)).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.05)
    return drafter


def train_result(
    store: ArtifactStore,
    run: str,
    target: TargetInfo,
    tmp,
    key: str = "untrained",
    corpus: StageResult | None = None,
) -> StageResult:
    """A train stage's output as the train stage lays it out: `drafter/` and a manifest. With `corpus`,
    the draft vocab is chosen from its token counts as training chooses it (else the first 512 ids)."""
    drafter = random_drafter(target)
    if corpus is not None:
        counts = load_token_counts(store, corpus, target.geometry.vocab_size)
        vocab = build_vocab_map(counts, drafter.d2t.numel())
        drafter.set_vocab(vocab.d2t, vocab.t2d)
    out = export_drafter(drafter, tmp / "drafter-export", target, {"note": "untrained"})
    stage_dir = StageDir(store, run, "train", key)
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        store.put_file(stage_dir.path(f"drafter/{path.relative_to(out).as_posix()}"), path)
    figures = {"accept_length": 1.5, "accept_length_rounds": 1.25, "draft_vocab_size": drafter.d2t.numel()}
    return stage_dir.finish({"figures": figures, "files": {"drafter": ["drafter/"]}})
