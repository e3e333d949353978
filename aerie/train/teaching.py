"""What every family's training objective shares: the teacher (the target's head over the draft or
whole vocabulary), the chunked soft cross-entropy, the metric rows and their summary, and the held-out
walk in rounds (`walk_answers`: each answer walked the way the speculative decoder walks it). The
families' objectives (`aerie.train.objective` for EAGLE-3, `aerie.train.dflash_objective`) and the
training loop import them from here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from aerie.train.data import Batch
from aerie.train.fused import EAGER_CHUNK_ELEMENTS, SOFT_CE, TEACHER

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


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[object]:
    """bf16 autocast on CUDA; nothing on the CPU (fp32 there)."""
    return torch.autocast("cuda", dtype=dtype) if device.type == "cuda" else contextlib.nullcontext()
