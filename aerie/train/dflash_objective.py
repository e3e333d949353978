"""The DFlash training objective: blocks after sampled anchors, every drafted slot predicted at once.

Anchors: in each document of a packed row, up to `anchors_per_sequence` rows a are drawn (seeded,
without replacement) among those whose next token x_{a+1} is a supervised (assistant) token of the
same document. The block of anchor a is [x_a, m, ..., m] (`aerie.draft.dflash`); its slot j (1..B-1)
predicts x_{a+j}. That slot is supervised when x_{a+j} is in a's document and is an assistant token.

The target's distribution of x_{a+j} is its lm_head on its final hidden state of row a+j-1 (the shard's
`last_hidden`). Loss = soft cross-entropy to it over the full target vocabulary (the drafter logits are
the target's head too), averaged per slot over its supervised blocks, slot j weighted
exp(-(j-1)/loss_decay): the first drafted tokens decide most of the acceptance, as in DFlash.

Metrics are the shared ones (`aerie.train.teaching.summarize`): per slot j, acc (the draft's argmax is the
target's), cond_acc (the same among blocks whose slots < j were all right), and
accept_length = 1 + sum_j prod_{i<=j} cond_acc_i, what greedy verification of the block accepts.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from aerie.draft.dflash import DFlashDrafter
from aerie.draft.dflash_export import dflash_config_for
from aerie.draft.target_weights import load_embedding, load_lm_head
from aerie.families import DFlashSettings
from aerie.targets import TargetInfo
from aerie.train.config import TrainConfig
from aerie.train.data import Batch
from aerie.train.teaching import (
    STAT_ROWS,
    Reduce,
    Teacher,
    _identity,
    autocast,
    document_weights,
    soft_cross_entropy,
    walk_answers,
)

if TYPE_CHECKING:
    from aerie.train.running import RunningLoop

EVAL_ANCHORS = 64  # anchors per held-out forward: [64 * (B-1), V] logits at a time


def sample_anchors(batch: Batch, per_document: int, block_size: int, generator: torch.Generator) -> Tensor:
    """Row indices [A] of the anchors of one packed row, sorted (see the module docstring)."""
    doc, mask = batch.doc_ids.cpu(), batch.loss_mask.cpu()
    t = doc.shape[0]
    eligible = torch.zeros(t, dtype=torch.bool)
    eligible[:-1] = (doc[:-1] == doc[1:]) & mask[1:] & (doc[:-1] >= 0)
    chosen = []
    for d in torch.unique(doc[eligible]).tolist():
        rows = torch.nonzero(eligible & (doc == d)).flatten()
        if rows.numel() > per_document:
            rows = rows[torch.randperm(rows.numel(), generator=generator)[:per_document]]
        chosen.append(rows)
    if not chosen:
        return torch.zeros(0, dtype=torch.long, device=batch.doc_ids.device)
    return torch.cat(chosen).sort().values.to(batch.doc_ids.device)


def block_labels(batch: Batch, anchors: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """(rows [A, B-1]: the row a+j-1 whose target distribution slot j learns; valid [A, B-1] bool)."""
    t = batch.doc_ids.shape[0]
    offsets = torch.arange(1, block_size, device=anchors.device)
    label_rows = anchors[:, None] + offsets  # a + j
    inside = label_rows < t
    clamped = label_rows.clamp(max=t - 1)
    same_doc = batch.doc_ids[clamped] == batch.doc_ids[anchors][:, None]
    valid = inside & same_doc & batch.loss_mask[clamped]
    return clamped - 1, valid


def slot_weights(block_size: int, loss_decay: float, device: torch.device) -> Tensor:
    """[B-1]: exp(-(j-1)/loss_decay) for slots j = 1..B-1."""
    return torch.tensor([math.exp(-j / loss_decay) for j in range(block_size - 1)], device=device)


def block_loss(
    drafter: DFlashDrafter,
    teacher: Teacher,
    batch: Batch,
    anchors: Tensor,
    loss_decay: float,
    *,
    reduce: Reduce = _identity,
    world_size: int = 1,
    model: nn.Module | None = None,
    per_document: bool = False,
) -> tuple[Tensor, Tensor]:
    """(weighted loss, metric sums [5, B-1] with `STAT_ROWS`) of the blocks after `anchors`.

    `teacher` is the target's full lm_head (`Teacher(lm_head, arange(V), ...)`): the draft vocabulary
    of DFlash is the target's. Each slot's loss is normalised by its supervised count over all ranks
    (`reduce`) and multiplied by `world_size`, because DDP averages gradients over ranks. `model` runs
    the forward when it is not `drafter` itself (DDP around it). `per_document` weighs every document
    the same (`train.loss_normalization: sequence`): each slot's loss is the mean over documents of each
    document's mean over its supervised blocks."""
    loss, stats, _ = block_scores(
        drafter, teacher, batch, anchors, loss_decay, reduce, world_size, model, per_document
    )
    return loss, stats


def block_scores(
    drafter: DFlashDrafter,
    teacher: Teacher,
    batch: Batch,
    anchors: Tensor,
    loss_decay: float,
    reduce: Reduce = _identity,
    world_size: int = 1,
    model: nn.Module | None = None,
    per_document: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """`block_loss`'s loss and sums, and correct [A, B-1] bool: slot j of anchor i is supervised and its
    draft is the target's argmax (what the held-out walk reads)."""
    b = drafter.config.block_size
    stats = torch.zeros(len(STAT_ROWS), b - 1, device=anchors.device)
    if anchors.numel() == 0:
        none = torch.zeros(0, b - 1, dtype=torch.bool, device=anchors.device)
        return batch.aux_hidden.new_zeros((), dtype=torch.float32, requires_grad=False), stats, none
    forward = model if model is not None else drafter
    out = forward(batch.aux_hidden, batch.input_ids, batch.positions, batch.doc_ids, anchors)  # [A, B, H]
    logits = drafter.logits(out[:, 1:].reshape(-1, out.shape[-1]))  # [A*(B-1), V]
    rows, valid = block_labels(batch, anchors, b)
    probs, teacher_argmax = teacher.distribution(batch.last_hidden[rows.reshape(-1)], logits.dtype)
    ce, draft_argmax = soft_cross_entropy(logits, probs)
    ce, valid_f = ce.view(-1, b - 1), valid.float()
    counts = valid_f.sum(0)  # [B-1]
    if per_document:
        docs = batch.doc_ids[anchors]
        per = torch.stack([document_weights(docs, valid[:, j]) for j in range(b - 1)], dim=1)  # [A, B-1]
    else:
        per = valid_f
    weights = slot_weights(b, loss_decay, anchors.device) * world_size / reduce(per.sum(0)).clamp(min=1e-9)
    loss = (ce * per * weights).sum()
    with torch.no_grad():
        correct = (draft_argmax == teacher_argmax).view(-1, b - 1) & valid
        chain_ok = torch.cumprod(correct.long(), dim=1).bool()  # slots 1..j all right
        before_ok = torch.cat([torch.ones_like(chain_ok[:, :1]), chain_ok[:, :-1]], dim=1)
        stats[0] = (ce * valid_f).sum(0)
        stats[1] = counts
        stats[2] = correct.sum(0)
        stats[3] = (before_ok & correct).sum(0)
        stats[4] = (before_ok & valid).sum(0)
    return loss, stats, correct


def block_hits(anchors: Tensor, correct: Tensor, rows: int) -> list[Tensor]:
    """The blocks' hits in EAGLE-3's alignment, for `walk_answers`: hits[k] [rows-2-k] bool, row t's
    step k naming x_{t+2+k}. The block after anchor a drafts x_{a+1+k} at slot k+1, which is the
    chain the decoder would draft from row a-1 (both follow the committed token x_a)."""
    width = correct.shape[1]
    hits = [torch.zeros(max(rows - 2 - k, 0), dtype=torch.bool, device=correct.device) for k in range(width)]
    for k in range(width):
        t = anchors - 1
        keep = (t >= 0) & (t < hits[k].shape[0])
        hits[k][t[keep]] = correct[keep, k]
    return hits


class DFlashObjective:
    """DFlash's part of the training loop (`aerie.families.protocols.Objective`): blocks after sampled anchors,
    taught by the target's full head; held out, a block after every anchor, walked in rounds."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        assert isinstance(cfg.drafter, DFlashSettings), cfg.drafter
        self.block = cfg.drafter
        self.width = cfg.drafter.block_size - 1  # metric columns: one per drafted slot

    def drafter(
        self, target: TargetInfo, draft_vocab_size: int, dtype: torch.dtype = torch.float32
    ) -> DFlashDrafter:
        """A fresh drafter for `target`; its vocabulary is the target's whatever `draft_vocab_size` says."""
        config = dflash_config_for(
            target,
            target_layer_ids=self.cfg.capture_layers(target.geometry.num_layers),
            block_size=self.block.block_size,
            num_layers=self.block.num_layers,
            mask_token_id=self.block.mask_token_id,
            shape=self.cfg.draft.resolve(target.geometry),
        )
        return DFlashDrafter(config, load_embedding(target, dtype), load_lm_head(target, dtype))

    def build(
        self, target: TargetInfo, vocab: dict[str, Tensor], dtype: torch.dtype
    ) -> tuple[DFlashDrafter, Teacher]:
        drafter = self.drafter(target, target.geometry.vocab_size, dtype)
        v = target.geometry.vocab_size
        return drafter, Teacher(load_lm_head(target), torch.arange(v), torch.ones(v, dtype=torch.bool))

    def loss(
        self, tr: RunningLoop, model: nn.Module, batch: Batch, reduce: Reduce, *, step: int = 0
    ) -> tuple[Tensor, Tensor]:
        """Blocks after anchors drawn for this step and rank (a resumed run draws the same ones)."""
        generator = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step * 1009 + tr.dist.rank)
        anchors = sample_anchors(batch, self.block.anchors_per_sequence, self.block.block_size, generator)
        with autocast(tr.device, tr.dtype):
            return block_loss(
                cast(DFlashDrafter, tr.drafter), tr.teacher, batch, anchors, self.block.loss_decay,
                reduce=reduce, world_size=tr.dist.world, model=model,
                per_document=self.cfg.loss_normalization == "sequence",
            )  # fmt: skip

    @torch.no_grad()
    def evaluate(self, tr: RunningLoop, batch: Batch) -> tuple[Tensor, tuple[int, int]]:
        """Every anchor of a held-out row, in groups (their logits are [group * (B-1), V]); the answers
        walked as the decoder walks them."""
        drafter = cast(DFlashDrafter, tr.drafter)
        anchors = sample_anchors(batch, batch.tokens, self.block.block_size, torch.Generator())
        stats = torch.zeros(len(STAT_ROWS), self.width, device=tr.device)
        correct = torch.zeros(0, self.width, dtype=torch.bool, device=tr.device)
        for group in anchors.split(EVAL_ANCHORS):
            with autocast(tr.device, tr.dtype):
                _loss, part, right = block_scores(drafter, tr.teacher, batch, group, self.block.loss_decay)
            stats += part
            correct = torch.cat([correct, right])
        return stats, walk_answers(batch, block_hits(anchors, correct, batch.input_ids.shape[0]))

    def window_loss(self, summary: dict[str, float | list[float]]) -> float:
        losses = summary["loss"]
        assert isinstance(losses, list)
        weights = slot_weights(len(losses) + 1, self.block.loss_decay, torch.device("cpu")).tolist()
        return float(sum(w * x for w, x in zip(weights, losses, strict=True)))
