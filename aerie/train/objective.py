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

import contextlib
from collections.abc import Callable, Iterator
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
from aerie.train.fused import EAGER_CHUNK_ELEMENTS, SOFT_CE, TEACHER

if TYPE_CHECKING:
    from aerie.train.running import RunningLoop

STAT_ROWS = ("loss_sum", "count", "correct", "cond_num", "cond_den")

Reduce = Callable[[Tensor], Tensor]


def _identity(x: Tensor) -> Tensor:
    return x


class Teacher:
    """The target's lm_head sliced to the draft vocab (and, for exact eval accuracy, the full head)."""

    def __init__(self, lm_head: Tensor, used: Tensor, t2d: Tensor, keep_full: bool = True) -> None:
        self.head = lm_head[used].float().contiguous()  # [Vd, H], fp32: the teacher's logits are fp32
        self.full = lm_head if keep_full else None  # [V, H]
        self.t2d = t2d  # [V] bool

    def to(self, device: torch.device | str, dtype: torch.dtype) -> Teacher:
        """On `device`; the full head (eval only) in `dtype`, the draft-vocab head stays fp32."""
        moved = object.__new__(Teacher)
        moved.head = self.head.to(device)
        moved.full = None if self.full is None else self.full.to(device, dtype)
        moved.t2d = self.t2d.to(device)
        return moved

    @torch.no_grad()
    def distribution(self, last_hidden: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """last_hidden [T, H] -> (probs [T, Vd] in `dtype`, argmax [T] in draft ids); fp32 logits, chunked.

        Logits rounded to bf16 would move a peaked teacher's probabilities by several percent; fp32 (TF32
        tensor cores on GPU, ~1e-3 relative) keeps them, at a few percent of the step's time.
        """
        t, vd = last_hidden.shape[0], self.head.shape[0]
        probs = torch.empty(t, vd, device=last_hidden.device, dtype=dtype)
        argmax = torch.empty(t, device=last_hidden.device, dtype=torch.int64)
        rows = TEACHER.chunk_rows(last_hidden.device, vd)
        with _tf32(last_hidden.is_cuda):
            for s in range(0, t, rows):
                logits = last_hidden[s : s + rows].float() @ self.head.T  # [rows, Vd] fp32
                (argmax[s : s + rows],) = TEACHER(logits, probs[s : s + rows])
        return probs, argmax

    @torch.no_grad()
    def argmax_in_draft_vocab(self, last_hidden: Tensor) -> Tensor:
        """[T] bool: the target's full-vocab argmax is a draft-vocab token (else no draft can be right)."""
        if self.full is None:
            return torch.ones(last_hidden.shape[0], dtype=torch.bool, device=last_hidden.device)
        t, v = last_hidden.shape[0], self.full.shape[0]
        rows = max(1, EAGER_CHUNK_ELEMENTS // v)
        out = torch.empty(t, dtype=torch.bool, device=last_hidden.device)
        for s in range(0, t, rows):
            out[s : s + rows] = self.t2d[(last_hidden[s : s + rows] @ self.full.T).argmax(-1)]
        return out


@contextlib.contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    """fp32 matmuls on TF32 tensor cores (CUDA only) for the duration, then the previous setting."""
    if not enabled:
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


class SoftCrossEntropy(torch.autograd.Function):
    """(ce [N] fp32, argmax [N]) for logits [N, Vd] and target probs [M, Vd], M <= N.

    ce[i] = -sum_v p[i, v] log softmax(z[i])_v for i < M; rows i >= M have no target: ce 0, gradient 0.
    Taking all N rows (not logits[:M]) keeps autograd from building a zero-padded [N, Vd] gradient for a
    slice. The gradient softmax(z) * sum(p) - p is computed in the forward, chunk by chunk (fused on CUDA),
    and saved in the logits' dtype; backward scales it by grad_ce in place. argmax (not differentiable) is
    the logits' per-row argmax, for the accuracy metrics, read in the same pass.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        n, vd = logits.shape
        m = probs.shape[0]
        ce = torch.zeros(n, device=logits.device, dtype=torch.float32)
        argmax = torch.empty(n, device=logits.device, dtype=torch.int64)
        grad = torch.empty_like(logits)
        rows = SOFT_CE.chunk_rows(logits.device, vd)
        for s in range(0, m, rows):
            e = min(s + rows, m)
            ce[s:e], argmax[s:e] = SOFT_CE(logits[s:e], probs[s:e], grad[s:e])
        grad[m:].zero_()
        argmax[m:] = logits[m:].argmax(-1)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(argmax)
        return ce, argmax

    @staticmethod
    def backward(ctx, grad_ce: Tensor, _grad_argmax: Tensor | None) -> tuple[Tensor, None]:  # type: ignore[override]
        # In place: the saved gradient is used once (a second backward fails autograd's version check).
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_ce[:, None]), None


def soft_cross_entropy(logits: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:
    """`SoftCrossEntropy` (typed): (ce [N] fp32, argmax [N]); rows past probs' M have ce 0."""
    ce, argmax = SoftCrossEntropy.apply(logits, probs)
    return ce, argmax


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


def document_weights(documents: Tensor, keep: Tensor) -> Tensor:
    """[n] float: for each kept entry 1 / (kept entries of its document), 0 elsewhere; a sum of values
    times these weights is the sum over documents of each document's mean (their sum is the number of
    documents with a kept entry)."""
    ids = torch.where(keep, documents, torch.full_like(documents, -1))
    _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    return keep.float() / counts[inverse].float()


def summarize(stats: Tensor) -> dict[str, float | list[float]]:
    """Metric sums [5, K] -> per-step loss / acc / cond_acc and the expected acceptance length."""
    s = stats.double().cpu()
    count = s[1].clamp(min=1)
    cond = s[3] / s[4].clamp(min=1)
    return {
        "loss": [round(float(x), 6) for x in s[0] / count],
        "acc": [round(float(x), 6) for x in s[2] / count],
        "cond_acc": [round(float(x), 6) for x in cond],
        "supervised": [int(x) for x in s[1]],
        "accept_length": round(1.0 + float(torch.cumprod(cond, 0).sum()), 6),
    }


def weighted_loss(summary: dict[str, float | list[float]], step_decay: float) -> float:
    """The scalar the optimizer minimises, from per-step losses (for logs)."""
    losses = summary["loss"]
    assert isinstance(losses, list)
    return float(sum(step_decay**k * x for k, x in enumerate(losses)))


def simulate_rounds(hits: Tensor, prompt_len: int, total_len: int, max_new_tokens: int) -> list[int]:
    """Drafts accepted per round when speculative decoding walks the answer x_{prompt_len}..x_{total_len-1}.

    hits [steps, >= total_len-2] bool: step k of row t names token t+2+k (the trainer's alignment: row
    t's step k predicts x_{t+2+k}). The committed text ends at x_m, the drafter's last pair is row m-1,
    its step k predicts x_{m+1+k}; a round accepts the longest correct prefix of its chain and the
    target's bonus token, and the next round starts after them. The first round starts after the
    prefill's token x_{prompt_len}. As in `SpecDecoder._round`, a chain holds at most
    `max_new_tokens - generated - 1` drafts (what may still be emitted, less the bonus)."""
    steps = hits.shape[0]
    first = max(prompt_len - 1, 0)
    # leading[i]: how many of row (first + i)'s drafts are right before its first miss.
    leading = hits[:, first : max(first, total_len - 2)].to(torch.int64).cumprod(0).sum(0).tolist()
    accepted: list[int] = []
    m = prompt_len
    while m < total_len - 1:
        chain = min(steps, max_new_tokens - (m - prompt_len + 1) - 1, total_len - m - 1)
        a = max(0, min(leading[m - 1 - first], chain))
        accepted.append(a)
        m += a + 1
    return accepted


def answer_spans(batch: Batch) -> list[tuple[int, int]]:
    """(s, e): each maximal run s..e-1 of supervised positions inside one document of a packed row, with
    the row before s in the same document (the drafter's first pair of the walk). A span that opens its
    document (the cut-off remainder of a long sample) drops its first token: it has no row to draft from."""
    mask = (batch.loss_mask & (batch.doc_ids >= 0)).cpu()
    doc = batch.doc_ids.cpu()
    same = doc[1:] == doc[:-1]  # [T-1]: positions p and p+1 are in one document
    cont = mask[1:] & mask[:-1] & same
    no = torch.zeros(1, dtype=torch.bool)
    starts = (mask & ~torch.cat([no, cont])).nonzero().flatten().tolist()
    ends = (mask & ~torch.cat([cont, no])).nonzero().flatten().add(1).tolist()
    opens = torch.cat([torch.ones(1, dtype=torch.bool), ~same])  # [T]: p is its document's first row
    return [(s + int(opens[s]), e) for s, e in zip(starts, ends, strict=True)]


def walk_answers(batch: Batch, hits: list[Tensor], max_new_tokens: int = 1 << 30) -> tuple[int, int]:
    """(rounds, verify tokens) of every answer span of `batch` walked by `simulate_rounds`, hits from
    `ttt_loss` (at most ttt_length drafts a chain). Tokens are those after each answer's first (the
    prefill's), as `aerie.evaluate.diagnose` and the decoder's accept length count them."""
    t = batch.input_ids.shape[0]
    matrix = torch.zeros(len(hits), t - 1, dtype=torch.bool, device=hits[0].device)
    for k, row in enumerate(hits):
        matrix[k, : row.shape[0]] = row
    matrix = matrix.cpu()
    rounds = tokens = 0
    for s, e in answer_spans(batch):
        if e - s >= 2:
            rounds += len(simulate_rounds(matrix, s, e, max_new_tokens))
            tokens += e - s - 1
    return rounds, tokens


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


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[object]:
    """bf16 autocast on CUDA; nothing on the CPU (fp32 there)."""
    return torch.autocast("cuda", dtype=dtype) if device.type == "cuda" else contextlib.nullcontext()


def _init_head_from_target(drafter: Eagle3Drafter, lm_head: Tensor, used: Tensor, target: TargetInfo) -> None:
    """Start from the target's own head (rows of the draft vocab) and final norm: a drafter whose layer
    reproduces the target's last hidden state is then right from step one."""
    with torch.no_grad():
        drafter.lm_head.weight.copy_(lm_head[used])
        norm = load_final_norm(target)
        if norm is not None:
            drafter.norm.weight.copy_(norm)
