"""The DFlash training objective: blocks after sampled anchors, every drafted slot predicted at once.

Anchors: in each document of a packed row, up to `anchors_per_sequence` rows a are drawn (seeded,
without replacement) among those whose next token x_{a+1} is a supervised (assistant) token of the
same document. The block of anchor a is [x_a, m, ..., m] (`aerie.draft.dflash`); its slot j (1..B-1)
predicts x_{a+j}. That slot is supervised when x_{a+j} is in a's document and is an assistant token.

The target's distribution of x_{a+j} is its lm_head on its final hidden state of row a+j-1 (the shard's
`last_hidden`). Loss = soft cross-entropy to it over the full target vocabulary (the drafter logits are
the target's head too), averaged per slot over its supervised blocks, slot j weighted
exp(-(j-1)/loss_decay): the first drafted tokens decide most of the acceptance, as in DFlash.

Metrics are EAGLE-3's (`aerie.train.objective.summarize`): per slot j, acc (the draft's argmax is the
target's), cond_acc (the same among blocks whose slots < j were all right), and
accept_length = 1 + sum_j prod_{i<=j} cond_acc_i, what greedy verification of the block accepts.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from aerie.draft.dflash import DFlashDrafter
from aerie.train.data import Batch
from aerie.train.objective import STAT_ROWS, Teacher, soft_cross_entropy


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
    drafter: DFlashDrafter, teacher: Teacher, batch: Batch, anchors: Tensor, loss_decay: float
) -> tuple[Tensor, Tensor]:
    """(weighted loss, metric sums [5, B-1] with `STAT_ROWS`) of the blocks after `anchors`.

    `teacher` is the target's full lm_head (`Teacher(lm_head, arange(V), ...)`): the draft vocabulary
    of DFlash is the target's."""
    b = drafter.config.block_size
    stats = torch.zeros(len(STAT_ROWS), b - 1, device=anchors.device)
    if anchors.numel() == 0:
        return batch.aux_hidden.new_zeros((), dtype=torch.float32, requires_grad=False), stats
    out = drafter(batch.aux_hidden, batch.input_ids, batch.positions, batch.doc_ids, anchors)  # [A, B, H]
    logits = drafter.logits(out[:, 1:].reshape(-1, out.shape[-1]))  # [A*(B-1), V]
    rows, valid = block_labels(batch, anchors, b)
    probs, teacher_argmax = teacher.distribution(batch.last_hidden[rows.reshape(-1)], logits.dtype)
    ce, draft_argmax = soft_cross_entropy(logits, probs)
    ce, valid_f = ce.view(-1, b - 1), valid.float()
    counts = valid_f.sum(0)  # [B-1]
    weights = slot_weights(b, loss_decay, anchors.device) / counts.clamp(min=1)
    loss = (ce * valid_f * weights).sum()
    with torch.no_grad():
        correct = (draft_argmax == teacher_argmax).view(-1, b - 1) & valid
        chain_ok = torch.cumprod(correct.long(), dim=1).bool()  # slots 1..j all right
        before_ok = torch.cat([torch.ones_like(chain_ok[:, :1]), chain_ok[:, :-1]], dim=1)
        stats[0] = (ce * valid_f).sum(0)
        stats[1] = counts
        stats[2] = correct.sum(0)
        stats[3] = (before_ok & correct).sum(0)
        stats[4] = (before_ok & valid).sum(0)
    return loss, stats
