"""The objective's elementwise work over [rows, Vd] as fused kernels on CUDA, eager everywhere else.

Per row chunk, the soft cross-entropy and its gradient are computed together in the forward:
ce = lse(z) * sum(p) - sum(p * z) and g = softmax(z) * sum(p) - p, plus the argmax of z that the
accuracy metrics need. On CUDA `torch.compile` (inductor) is meant to turn each into one kernel that reads
z and p a few times and writes g once in the logits' dtype (so it does in inductor's CPU code here; the
CUDA code has not been inspected yet); eagerly (CPU, tests, a failed compile) the same
quantities cost about eight passes with fp32 temporaries. The teacher's softmax + argmax is the second
kernel.

A compiled kernel is trusted only after its first chunk agreed with its eager twin (on the leading
CHECK_ROWS rows); any exception (the compiler missing, inductor failing, a disagreement) switches that kernel to
eager for the rest of the process, logs a warning and shows in `fused_backend()`, which the training
benchmark records with its figures.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from aerie.errors import TrainingError

log = logging.getLogger(__name__)

Rows = Callable[..., tuple[Tensor, ...]]
Agree = Callable[[tuple[Tensor, ...], tuple[Tensor, ...], tuple[Tensor, ...]], str]

# Elements per row chunk: eager work makes a few fp32 [rows, Vd] temporaries (128 MiB each at 2**25); a
# fused kernel makes none, so its chunks are large and the Python-side cost per chunk is paid rarely.
EAGER_CHUNK_ELEMENTS = 1 << 25
FUSED_CHUNK_ELEMENTS = 1 << 28
CHECK_ROWS = 256  # rows of the first compiled chunk that are recomputed eagerly to check it


def soft_ce_rows_eager(z: Tensor, p: Tensor, g_out: Tensor) -> tuple[Tensor, Tensor]:
    """(ce [R] fp32, argmax [R]) for logits z / target probs p [R, Vd]; g_out [R, Vd] <- d ce / d z.

    One softmax kernel gives both the gradient and the log-normaliser: at the argmax softmax is
    1 / sum(exp(z - max)), so lse = max - log(softmax[argmax]), logsumexp's value to fp32 rounding.
    """
    zf, pf = z.float(), p.float()
    softmax = torch.softmax(zf, -1)
    top = zf.argmax(-1, keepdim=True)
    lse = zf.gather(-1, top) - softmax.gather(-1, top).log()
    psum = pf.sum(-1, keepdim=True)
    ce = lse * psum - (pf * zf).sum(-1, keepdim=True)
    g_out.copy_(softmax.mul_(psum).sub_(pf))
    return ce.squeeze(-1), top.squeeze(-1)


def soft_ce_rows_fusable(z: Tensor, p: Tensor, g_out: Tensor) -> tuple[Tensor, Tensor]:
    """The same as `soft_ce_rows_eager`, written for inductor: every [R, Vd] value is a pointwise
    function of z and p and row scalars, so nothing of that size is stored but g (softmax is
    recomputed as exp(z - lse) instead of being kept between the row sum and the gradient)."""
    zf, pf = z.float(), p.float()
    top = zf.argmax(-1)
    m = zf.amax(-1, keepdim=True)
    lse = m + torch.exp(zf - m).sum(-1, keepdim=True).log()
    psum = pf.sum(-1, keepdim=True)
    ce = lse * psum - (pf * zf).sum(-1, keepdim=True)
    g_out.copy_(torch.exp(zf - lse) * psum - pf)
    return ce.squeeze(-1), top


def teacher_rows(logits: Tensor, probs_out: Tensor) -> tuple[Tensor]:
    """probs_out [R, Vd] <- softmax of fp32 logits (rounded once, to probs_out's dtype); (argmax [R],)."""
    probs_out.copy_(torch.softmax(logits, -1))
    return (logits.argmax(-1),)


def _argmax_hits_max(z: Tensor, ours: Tensor, ref: Tensor) -> bool:
    """Argmaxes agree when they point at equal values (ties may be broken differently)."""
    return bool(torch.equal(z.gather(-1, ours[:, None]), z.gather(-1, ref[:, None])))


def _relative(a: Tensor, b: Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def soft_ce_agree(args: tuple[Tensor, ...], ours: tuple[Tensor, ...], ref: tuple[Tensor, ...]) -> str:
    """ "" when a compiled soft-CE chunk matches eager's (outputs then g), else what differs."""
    z = args[0]
    (ce, top, g), (ce_ref, top_ref, g_ref) = ours, ref
    ce_err = float(((ce - ce_ref).abs() / (1 + ce_ref.abs())).max()) if ce.numel() else 0.0
    if ce_err > 1e-3:
        return f"cross-entropy differs from eager (relative {ce_err:.3g})"
    if not _argmax_hits_max(z, top, top_ref):
        return "argmax points at a smaller logit than eager's"
    g_err = _relative(g, g_ref)
    return f"gradient differs from eager (relative {g_err:.3g})" if g_err > 1e-2 else ""


def teacher_agree(args: tuple[Tensor, ...], ours: tuple[Tensor, ...], ref: tuple[Tensor, ...]) -> str:
    """ "" when a compiled teacher chunk matches eager's (argmax then probs), else what differs."""
    (top, probs), (top_ref, probs_ref) = ours, ref
    if not _argmax_hits_max(args[0], top, top_ref):
        return "argmax points at a smaller logit than eager's"
    err = _relative(probs, probs_ref)
    return f"probabilities differ from eager (relative {err:.3g})" if err > 1e-2 else ""


class FusedKernel:
    """Runs `fusable` compiled on `devices`, `eager` elsewhere or once compiling has failed.

    Both take the chunk's inputs and, last, an output tensor they fill; they return a tuple of tensors.
    `agree(inputs, compiled outputs, eager outputs)` says what differs ("" if nothing); `backend` is
    torch.compile's (tests use dynamo's "eager" backend to reach the fallbacks without a C++ compiler).
    """

    def __init__(
        self,
        name: str,
        eager: Rows,
        fusable: Rows,
        agree: Agree,
        devices: Sequence[str] = ("cuda",),
        backend: str = "inductor",
    ) -> None:
        self.name = name
        self.eager = eager
        self.fusable = fusable
        self.agree = agree
        self.devices = tuple(devices)
        self.backend = backend
        self.failure = ""  # why this kernel runs eager on `devices` ("" while it does not)
        self.ran_compiled = False  # a compiled call has run and agreed with eager
        self._compiled: Rows | None = None

    def compiles_on(self, device: torch.device) -> bool:
        return device.type in self.devices and not self.failure

    def chunk_rows(self, device: torch.device, width: int) -> int:
        elements = FUSED_CHUNK_ELEMENTS if self.compiles_on(device) else EAGER_CHUNK_ELEMENTS
        return max(1, elements // max(1, width))

    def __call__(self, *args: Tensor) -> tuple[Tensor, ...]:
        if self.compiles_on(args[0].device):
            try:
                return self._run_compiled(args)
            except torch.OutOfMemoryError:
                raise  # eager needs more memory, not less
            except Exception as exc:  # noqa: BLE001 - any compiler/runtime failure: fall back, say why
                self._fall_back(f"{type(exc).__name__}: {exc}")
        return self.eager(*args)

    def _run_compiled(self, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        if self._compiled is None:
            # Row counts vary (the last chunk of each call): dynamo recompiles once with a dynamic row
            # dim (plus a graph for a 1-row chunk); Vd and dtypes stay fixed in a process.
            self._compiled = torch.compile(self.fusable, fullgraph=True, backend=self.backend)
        out = self._compiled(*args)
        if not self.ran_compiled:
            self._check(args, out)
            self.ran_compiled = True
        return out

    def _check(self, args: tuple[Tensor, ...], out: tuple[Tensor, ...]) -> None:
        """The first compiled chunk's leading rows against eager: a wrong kernel must not train."""
        rows = min(args[0].shape[0], CHECK_ROWS)
        head = tuple(a[:rows] for a in args)
        scratch = torch.empty_like(head[-1])
        ref = self.eager(*head[:-1], scratch)
        problem = self.agree(head, tuple(o[:rows] for o in (*out, args[-1])), (*ref, scratch))
        if problem:
            raise TrainingError(f"compiled {self.name} kernel disagrees with eager: {problem}")

    def _fall_back(self, reason: str) -> None:
        self.failure = " ".join(reason.split())[:300]  # dynamo's messages run to many lines
        log.warning("fused %s kernel unusable, eager from now on: %s", self.name, self.failure)


SOFT_CE = FusedKernel("soft-cross-entropy", soft_ce_rows_eager, soft_ce_rows_fusable, soft_ce_agree)
TEACHER = FusedKernel("teacher-softmax", teacher_rows, teacher_rows, teacher_agree)
KERNELS = (SOFT_CE, TEACHER)


def fused_backend(kernels: Sequence[FusedKernel] = KERNELS) -> str:
    """How the objective's kernels ran, for benchmark figures: "inductor", "eager" (nothing compiled,
    e.g. on CPU), or per kernel "<name>: inductor | eager | eager fallback (<reason>)" once one failed."""
    states = [_state(k) for k in kernels]
    if not any(k.failure for k in kernels):
        compiled = sorted({s for s in states if s != "eager"})
        return ", ".join(compiled) if compiled else "eager"
    return "; ".join(f"{k.name}: {s}" for k, s in zip(kernels, states, strict=True))


def _state(kernel: FusedKernel) -> str:
    if kernel.failure:
        return f"eager fallback ({kernel.failure})"
    if not kernel.ran_compiled:
        return "eager"
    return "inductor" if kernel.backend == "inductor" else f"compiled ({kernel.backend})"
