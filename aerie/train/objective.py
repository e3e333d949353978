"""The training objective and the metrics that predict serving.

Alignment (anchors B1/B2): at TTT step k, row t predicts the target's distribution at position t+1+k,
i.e. the distribution of token x_{t+2+k}. That prediction is *supervised* when x_{t+2+k} is in the same
document and is an assistant token (loss_mask). Loss per step = soft cross-entropy to the target
distribution restricted to the draft vocab, averaged over that step's supervised rows (not over all
positions, which lets prompts and padding dilute the signal), weighted step_decay**k.

The teacher is compact: the target's lm_head rows of the draft vocab [Vd, H] applied to the stored final
hidden state, so no [T, V] tensor is ever built. Its distribution is computed once per batch (each step
reads a shifted view). The cross-entropy is a chunked autograd function that computes its gradient in the
forward and keeps only that ([T, Vd] in the logits' dtype, the same memory as keeping the logits), so the
backward is one multiply; on CUDA the per-chunk work runs as fused inductor kernels (`aerie.train.fused`).

Metrics, as sums over rows so they can be all-reduced and accumulated:
- acc_k: the draft's argmax equals the target's argmax (in eval: over the *full* target vocab, so a
  target token outside the draft vocab counts as a miss, exactly as at serving);
- cond_acc_k: the same, among rows whose steps 0..k-1 were all right (speculators' `cond_acc`);
- `accept_length` = 1 + sum_k prod_{j<=k} cond_acc_j: the per-position estimate of what a chain of
  ttt_length drafts gets accepted per target forward under greedy verification. It averages over *every*
  answer position, but decoding rounds start right after a rejection (or the bonus token), and positions
  right after a miss are harder than average, so it runs high (H200: 3.24 where the decoder measured 2.58);
- `accept_length_rounds` (eval only, `walk_answers`): each held-out answer walked in rounds the way the
  speculative decoder walks it (`simulate_rounds`): answer tokens after the first per round. This is the
  figure serving gets (on the decoder's own answers it equals the measured one exactly, see
  aerie/evaluate/diagnose.py), so the best checkpoint is chosen by it; `accept_length` stays as the
  smooth per-step summary that the cond_acc curves explain. On answers that are not the target's own
  greedy text the walk still follows the text as written (the decoder would have followed the target).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from aerie.draft.export import draft_config_for
from aerie.draft.model import Eagle3Drafter
from aerie.draft.target_weights import load_embedding, load_final_norm, load_lm_head
from aerie.errors import ConfigError
from aerie.families.eagle3 import Eagle3Settings
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


def supervised_rows(batch: Batch, ttt_length: int) -> list[Tensor]:
    """valid[k] [T-2-k] bool: row t's step-k prediction (of x_{t+2+k}) is in-document and supervised."""
    t = batch.input_ids.shape[0]
    out = []
    for k in range(ttt_length):
        n = t - 2 - k
        same_doc = batch.doc_ids[2 + k :] == batch.doc_ids[:n]
        out.append(same_doc & batch.loss_mask[2 + k :] & (batch.doc_ids[:n] >= 0))
    return out


def ttt_loss(
    logits: list[Tensor],
    probs: Tensor,
    teacher_argmax: Tensor,
    valid: list[Tensor],
    step_decay: float,
    *,
    in_vocab: Tensor | None = None,
    reduce: Reduce = _identity,
    world_size: int = 1,
    hits: list[Tensor] | None = None,
    documents: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Weighted loss (scalar) and the metric sums [5, K] (rows: STAT_ROWS), summed over all ranks.

    logits[k] [T, Vd] from the drafter, *emptied* as it is read: each step's logits are dropped once their
    gradient exists, so the K steps hold K + 1 [T, Vd] tensors at most, not 2K.
    probs [T, Vd] / teacher_argmax [T] from `Teacher.distribution`; valid from `supervised_rows`;
    in_vocab [T] from `Teacher.argmax_in_draft_vocab` (eval only). `hits`, when given (eval), receives
    per step k the [T-2-k] bool `correct & valid`: row t's step k names x_{t+2+k} (for `walk_answers`).
    The loss is normalised by the *global* supervised count of each step and multiplied by the world size,
    because DDP averages gradients over ranks. `documents` [T] (the row's doc ids), when given, weighs
    every document the same instead (`train.loss_normalization: sequence`): each step's loss is the mean
    over documents of each document's mean (`document_weights`).
    """
    k_steps = len(logits)
    counts = reduce(torch.stack([v.sum() for v in valid]).float())  # [K]
    if documents is None:
        weights, totals = [v.float() for v in valid], counts
    else:
        weights = [document_weights(documents[: v.shape[0]], v) for v in valid]
        totals = reduce(torch.stack([w.sum() for w in weights]))  # documents supervised at each step
    stats = torch.zeros(len(STAT_ROWS), k_steps, device=probs.device)
    stats[1] = counts
    loss = probs.new_zeros((), dtype=torch.float32)
    chain_ok = torch.ones_like(valid[0])
    for k in range(k_steps):
        n = valid[k].shape[0]
        ce, draft_argmax = soft_cross_entropy(logits.pop(0), probs[1 + k : 1 + k + n])
        ce = ce[:n]  # rows past n have no target: ce 0, no gradient
        weight = weights[k] * (step_decay**k * world_size / totals[k].clamp(min=1e-9))
        loss = loss + (ce * weight).sum()
        with torch.no_grad():
            correct = draft_argmax[:n] == teacher_argmax[1 + k : 1 + k + n]
            if in_vocab is not None:
                correct &= in_vocab[1 + k : 1 + k + n]
            chain_ok = chain_ok[:n]
            stats[0, k] = (ce * valid[k]).sum()
            stats[2, k] = (correct & valid[k]).sum()
            if hits is not None:
                hits.append(correct & valid[k])
            stats[3, k] = (chain_ok & correct & valid[k]).sum()
            stats[4, k] = (chain_ok & valid[k]).sum()
            chain_ok = chain_ok & correct
    stats[[0, 2, 3, 4]] = reduce(stats[[0, 2, 3, 4]])
    return loss, stats


def weighted_loss(summary: dict[str, float | list[float]], step_decay: float) -> float:
    """The scalar the optimizer minimises, from per-step losses (for logs)."""
    losses = summary["loss"]
    assert isinstance(losses, list)
    return float(sum(step_decay**k * x for k, x in enumerate(losses)))


class Eagle3Objective:
    """EAGLE-3's part of the training loop (`aerie.families.protocols.Objective`): one Llama layer unrolled
    `ttt_length` steps over each packed row, taught by the target's head over the draft vocabulary, and
    the held-out answers walked in rounds by its hits."""

    def __init__(self, cfg: TrainConfig) -> None:
        if not isinstance(cfg.drafter, Eagle3Settings):
            raise ConfigError(f"the EAGLE-3 objective trains train.drafter=eagle3, not {cfg.drafter.family}")
        self.cfg, self.settings = cfg, cfg.drafter
        self.width = self.settings.ttt_length  # metric columns: one per TTT step

    def drafter(
        self, target: TargetInfo, draft_vocab_size: int, dtype: torch.dtype = torch.float32
    ) -> Eagle3Drafter:
        """A fresh drafter for `target` (seed first for reproducible weights)."""
        draft_cfg = draft_config_for(target, draft_vocab_size, self.cfg.draft.resolve(target.geometry))
        return Eagle3Drafter(draft_cfg, load_embedding(target, dtype))

    def build(
        self, target: TargetInfo, vocab: dict[str, Tensor], dtype: torch.dtype
    ) -> tuple[Eagle3Drafter, Teacher]:
        """The drafter to train, its vocabulary maps set and (`init_head_from_target`) its head the
        target's rows of the draft vocab, and its teacher."""
        drafter = self.drafter(target, vocab["used"].numel(), dtype)
        drafter.set_vocab(vocab["d2t"], vocab["t2d"])
        lm_head = load_lm_head(target)
        if self.settings.init_head_from_target:
            _init_head_from_target(drafter, lm_head, vocab["used"], target)
        return drafter, Teacher(lm_head, vocab["used"], vocab["t2d"])

    def loss(
        self,
        tr: RunningLoop,
        model: nn.Module,
        batch: Batch,
        reduce: Reduce,
        *,
        step: int = 0,
        exact: bool = False,
        hits: list[Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """TTT forward over one packed row; (loss, metric sums [5, K]). `exact` checks the full-vocab
        argmax; `hits` (eval) receives each step's right-and-supervised rows (see `ttt_loss`)."""
        with autocast(tr.device, tr.dtype):
            logits = model(
                batch.aux_hidden,
                batch.input_ids,
                batch.positions,
                batch.doc_ids,
                self.settings.ttt_length,
                tr.attention,
                self.settings.recompute,
            )
        probs, teacher_argmax = tr.teacher.distribution(batch.last_hidden, logits[0].dtype)
        in_vocab = tr.teacher.argmax_in_draft_vocab(batch.last_hidden) if exact else None
        valid = supervised_rows(batch, self.settings.ttt_length)
        return ttt_loss(
            logits, probs, teacher_argmax, valid, self.settings.step_decay,
            in_vocab=in_vocab, reduce=reduce, world_size=tr.dist.world, hits=hits,
            documents=batch.doc_ids if self.cfg.loss_normalization == "sequence" else None,
        )  # fmt: skip

    def evaluate(self, tr: RunningLoop, batch: Batch) -> tuple[Tensor, tuple[int, int]]:
        """One held-out row: (metric sums [5, K], (rounds, verify tokens) of its answers walked)."""
        hits: list[Tensor] = []
        stats = self.loss(tr, tr.drafter, batch, _identity, exact=True, hits=hits)[1]
        return stats, walk_answers(batch, hits)

    def window_loss(self, summary: dict[str, float | list[float]]) -> float:
        return weighted_loss(summary, self.settings.step_decay)


def _init_head_from_target(drafter: Eagle3Drafter, lm_head: Tensor, used: Tensor, target: TargetInfo) -> None:
    """Start from the target's own head (rows of the draft vocab) and final norm: a drafter whose layer
    reproduces the target's last hidden state is then right from step one."""
    with torch.no_grad():
        drafter.lm_head.weight.copy_(lm_head[used])
        norm = load_final_norm(target)
        if norm is not None:
            drafter.norm.weight.copy_(norm)
