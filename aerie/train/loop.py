"""The drafter training loop and what it needs: `build_trainer` wires the parts, `train` is the loop.

`train` reads top to bottom: next packed row, TTT forward + loss, backward, clip, step; then on their
cadences a log record, a held-out evaluation (keeping the best drafter by its acceptance length with the
answers walked in rounds as the decoder walks them, `accept_length_rounds`, not by loss: drafters overfit
while the loss still falls), and a checkpoint. A SIGTERM or SIGINT (a time budget, a spot instance's
notice, Ctrl-C) stops the loop at the next step boundary with a checkpoint of that step, so the re-run
loses no steps (a second signal stops at once); it does so as well while the loop waits for its next
row (online: a server starting or restarting) and during the last step. Everything the outside world sees leaves through
`emit(record)`: the stage turns records into metrics.jsonl lines, progress and store uploads, whether the
loop runs in-process or in torchrun workers.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from pydantic import BaseModel
from safetensors.torch import load_file
from torch import Tensor, nn

from aerie.errors import TrainingError
from aerie.families import family_of
from aerie.families.protocols import Objective
from aerie.targets import TargetInfo
from aerie.train.checkpoint import TrainState, checkpoint_name, load_checkpoint, save_checkpoint, save_weights
from aerie.train.config import TrainConfig
from aerie.train.data import Batch, DataSource, EpochPlans, Prefetcher, SampleIndex, ShardSource
from aerie.train.distributed import DistInfo
from aerie.train.online import OnlineFeeder, OnlineSpec
from aerie.train.teaching import Teacher, summarize

Emit = Callable[[dict[str, Any]], None]
BEST = "best"


def objective_for(cfg: TrainConfig) -> Objective[Trainer, Batch, Teacher]:
    """`cfg.drafter`'s family part of the loop."""
    return family_of(cfg.drafter).objective.load()(cfg)


class TrainSpec(BaseModel):
    """Everything a trainer process needs, as JSON (the torchrun workers read it from a file)."""

    cfg: TrainConfig
    target: TargetInfo
    train_shards: list[str]
    eval_shards: list[str]
    vocab_path: str  # safetensors with used [Vd], d2t [Vd], t2d [V]
    work_dir: str
    device: str  # resolved: "cpu" or "cuda"
    resume_from: str | None = None
    online: OnlineSpec | None = None  # set: the rows come from extraction servers, not shards


@dataclass
class Trainer:
    cfg: TrainConfig
    objective: Objective[
        Trainer, Batch, Teacher
    ]  # what the drafter family decides: model, teacher, loss, held-out walk
    drafter: nn.Module  # the module whose weights are saved
    model: nn.Module  # what the step calls: the drafter, or DDP around it
    teacher: Teacher
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    train_plans: EpochPlans
    eval_plans: EpochPlans
    total_steps: int
    device: torch.device
    dtype: torch.dtype  # activations: bf16 on GPU (autocast), fp32 on CPU
    attention: str
    dist: DistInfo
    work_dir: Path
    emit: Emit
    source: DataSource  # the shards, or the online feeder's servers
    accumulate: int = 1  # rows per optimizer step and device (`train.batch_sequences`)


def train(tr: Trainer, state: TrainState, started: float | None = None) -> TrainState:
    """Run from `state.step` to `tr.total_steps`; returns the final state. `started`: when this run
    began (perf_counter; default now), so `state.elapsed_s` includes its start-up."""
    cfg, dist = tr.cfg, tr.dist
    started, elapsed_before = started or time.perf_counter(), state.elapsed_s
    # Exactly the rows the remaining steps take: a source reading further (online: extracting) would
    # work for rows no step uses, and one that ran out of rows would wait for them forever.
    remaining = (tr.total_steps - state.step) * tr.accumulate
    first = state.step * tr.accumulate * dist.world + dist.rank
    stream = Prefetcher(
        tr.source.batches(tr.train_plans, first, dist.world, remaining),
        cfg.prefetch_batches,
        pin=tr.device.type == "cuda",
    )
    window = torch.zeros(5, tr.objective.width, device=tr.device)
    window_start, window_tokens = time.perf_counter(), 0
    checkpointed = state.step  # a resumed state is its checkpoint's; step 0 has nothing to keep
    asked: list[int] = []
    try:
        with _stop_requests(enabled=dist.world == 1) as asked:
            while state.step < tr.total_steps:
                rows = step_rows(tr, stream, asked, state.step)
                if rows is None:  # asked to stop while the data was late: the last step is whole
                    if state.step != checkpointed:
                        save(tr, state)
                    tr.emit({"kind": "stopped", "step": state.step, "signal": asked[0]})
                    break
                loss, stats, tokens = rows
                grad_norm = torch.nn.utils.clip_grad_norm_(tr.drafter.parameters(), cfg.grad_clip)
                lr = float(tr.scheduler.get_last_lr()[0])
                tr.optimizer.step()
                tr.scheduler.step()
                tr.optimizer.zero_grad(set_to_none=True)
                state.step += 1
                state.tokens += tokens * dist.world
                state.elapsed_s = elapsed_before + time.perf_counter() - started
                window += stats
                window_tokens += tokens * dist.world
                last = state.step == tr.total_steps
                if state.step % cfg.log_every == 0 or last:
                    elapsed = time.perf_counter() - window_start
                    tr.emit(train_record(state, tr, window, loss, grad_norm, lr, window_tokens / elapsed))
                    window.zero_()
                    window_start, window_tokens = time.perf_counter(), 0
                if state.step % cfg.eval_every == 0 or last:
                    result = evaluate(tr)
                    if result["accept_length_rounds"] > state.best_accept_length_rounds:
                        state.best_accept_length_rounds = result["accept_length_rounds"]
                        state.best_step = state.step
                        save_best(tr, state, result)
                    tr.emit({"kind": "eval", "step": state.step, **result, "best_step": state.best_step})
                # A signal during the last step stops too: the caller asked this process to end, and the
                # export after training is a re-run's (it resumes at the last step and trains none).
                if state.step % cfg.checkpoint_every == 0 or last or asked:
                    save(tr, state)
                    checkpointed = state.step
                if asked:
                    tr.emit({"kind": "stopped", "step": state.step, "signal": asked[0]})
                    break
    finally:
        if asked:  # the online servers first: their pending requests fail, so the loader's thread ends
            tr.source.close()
        stream.close()
    if asked:  # the previous handlers are back; the signal as if it came now (its default skips `finally`)
        signal.raise_signal(asked[0])
    return state


def step_rows(
    tr: Trainer, stream: Prefetcher, asked: list[int], step: int
) -> tuple[Tensor, Tensor, int] | None:
    """Forward and backward of one optimizer step's `tr.accumulate` rows, each row's loss over
    `tr.accumulate` (the step's loss is the mean of its rows'): (that loss, metric sums, tokens); None
    when asked to stop while a row was late (the partial step's gradients are dropped)."""
    loss_sum: Tensor | None = None
    stats = torch.zeros(5, tr.objective.width, device=tr.device)
    tokens = 0
    for row in range(tr.accumulate):
        host_batch = stream.next_unless(lambda: bool(asked))
        if host_batch is None:
            tr.optimizer.zero_grad(set_to_none=True)
            return None
        batch = host_batch.to(tr.device, tr.dtype)
        # One row a step numbers rows by step, as before accumulation existed (a resume draws the same).
        index = step * tr.accumulate + row
        loss, part = tr.objective.loss(tr, tr.model, batch, tr.dist.reduce, step=index)
        (loss / tr.accumulate).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        stats += part
        tokens += batch.tokens
    assert loss_sum is not None  # accumulate >= 1
    return loss_sum / tr.accumulate, stats, tokens


@contextlib.contextmanager
def _stop_requests(enabled: bool) -> Iterator[list[int]]:
    """While training, SIGTERM and SIGINT only record themselves (in the yielded list) for the loop to
    stop at a step boundary, where a checkpoint is consistent; a second one gets the handler that was
    there before (e.g. a supervisor's SIGTERM raising SystemExit), at once. Off the main thread (where Python cannot
    install handlers), or not `enabled` (multi-process training, whose ranks would have to agree on the
    step), nothing changes."""
    asked: list[int] = []
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield asked
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def record(signum: int, frame: Any) -> None:
        if asked:
            restore()
            signal.raise_signal(signum)
        else:
            asked.append(signum)

    for sig in previous:
        signal.signal(sig, record)
    try:
        yield asked
    finally:
        restore()


@torch.no_grad()
def evaluate(tr: Trainer) -> dict[str, Any]:
    """Metrics over the held-out rows (each rank a share, summed once at the end): `summarize`'s per-step
    figures and per-position `accept_length`, plus `accept_length_rounds` (verify tokens per round when
    every held-out answer is walked in rounds, as the decoder walks it) and its `rounds`."""
    total = tr.eval_plans.batches_per_epoch
    if tr.cfg.eval_max_batches is not None:
        total = min(total, tr.cfg.eval_max_batches)
    mine = len(range(tr.dist.rank, total, tr.dist.world))
    batches = tr.source.batches(tr.eval_plans, tr.dist.rank, tr.dist.world, mine)
    return evaluate_batches(tr, (batch.to(tr.device, tr.dtype) for batch in batches))


@torch.no_grad()
def evaluate_batches(tr: Trainer, batches: Iterable[Batch]) -> dict[str, Any]:
    """`evaluate`'s figures over this rank's share of held-out rows (on the device), summed over ranks."""
    stats = torch.zeros(5, tr.objective.width, device=tr.device)
    walked = torch.zeros(2, dtype=torch.int64, device=tr.device)  # rounds, verify tokens
    for batch in batches:
        part, rounds_tokens = tr.objective.evaluate(tr, batch)
        stats += part
        walked += torch.tensor(rounds_tokens, device=tr.device)
    rounds, tokens = tr.dist.reduce(walked).tolist()
    # No answer of two tokens or more: no round to verify, nothing accepted.
    rounds_length = tokens / rounds if rounds else 1.0
    return {
        **summarize(tr.dist.reduce(stats)),
        "accept_length_rounds": round(rounds_length, 6),
        "rounds": rounds,
    }


def train_record(
    state: TrainState,
    tr: Trainer,
    window: Tensor,
    loss: Tensor,
    grad_norm: Tensor,
    lr: float,
    tokens_per_s: float,
) -> dict[str, Any]:
    summary = summarize(window)
    return {
        "kind": "train",
        "step": state.step,
        "total_steps": tr.total_steps,
        "loss": round(float(loss.detach()), 6),  # this step's objective (exact; resume is checked on it)
        "window_loss": round(tr.objective.window_loss(summary), 6),
        "step_loss": summary["loss"],
        "step_acc": summary["acc"],
        "cond_acc": summary["cond_acc"],
        "grad_norm": round(float(grad_norm), 6),
        "lr": lr,
        "tokens": state.tokens,
        "tokens_per_s": round(tokens_per_s, 1),
        "elapsed_s": round(state.elapsed_s, 3),
        "runs": state.runs,
    }


def save_best(tr: Trainer, state: TrainState, result: dict[str, Any]) -> None:
    """Weights of the best evaluation so far, and its figures (the stage writes them to best.json)."""
    if tr.dist.is_main:
        best = tr.work_dir / BEST
        best.mkdir(parents=True, exist_ok=True)
        save_weights(tr.drafter, best / ".model.tmp")
        (best / ".model.tmp").replace(best / "model.safetensors")
        figures = {name: result[name] for name in ("accept_length_rounds", "accept_length")}
        tr.emit({"kind": "best", "step": state.step, **figures})


def save(tr: Trainer, state: TrainState) -> None:
    if tr.dist.is_main:
        config = {"train": tr.cfg.model_dump(mode="json"), "draft": _draft_config(tr.drafter)}
        save_checkpoint(tr.work_dir / "checkpoints", tr.drafter, tr.optimizer, tr.scheduler, state, config)
        tr.emit({"kind": "checkpoint", "step": state.step, "name": checkpoint_name(state.step)})
    tr.dist.barrier()


def _draft_config(drafter: nn.Module) -> dict[str, Any]:
    """The drafter's shapes as checkpoints record them (every family's config has `to_dict`)."""
    return cast(dict[str, Any], drafter.config.to_dict())  # type: ignore[operator,union-attr]


# ----------------------------------------------------------------------------------------------- wiring


def build_trainer(spec: TrainSpec, dist: DistInfo, emit: Emit) -> tuple[Trainer, TrainState]:
    """Model, teacher, optimizer, schedule and data for `spec`; restored from `spec.resume_from` if set."""
    cfg = spec.cfg
    device = torch.device(spec.device, dist.local_rank) if spec.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    attention = cfg.attention if cfg.attention != "auto" else ("flex" if device.type == "cuda" else "dense")

    vocab = load_file(spec.vocab_path)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank and every run
    objective = objective_for(cfg)
    drafter, cpu_teacher = objective.build(spec.target, vocab, dtype)
    teacher = cpu_teacher.to(device, dtype)
    del cpu_teacher
    drafter.to(device)
    model: nn.Module = drafter
    if dist.world > 1:
        model = nn.parallel.DistributedDataParallel(
            drafter, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
        )

    source: DataSource = ShardSource()
    if spec.online is not None:
        source = OnlineFeeder(spec.online, cfg, spec.target, dist, emit)
    train_index, eval_index = _indices(spec, source)
    whole = not cfg.split_samples
    train_plans = EpochPlans(train_index, cfg.batch_tokens, cfg.max_length, cfg.seed, whole=whole)
    eval_plans = EpochPlans(
        eval_index, cfg.batch_tokens, cfg.max_length, cfg.seed, shuffle=False, whole=whole
    )
    accumulate = rows_per_step(cfg, train_index, dist.world)
    total_steps = max(1, math.floor(cfg.epochs * train_plans.batches_per_epoch / (dist.world * accumulate)))
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=device.type == "cuda"
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(cfg, total_steps))
    tr = Trainer(
        cfg, objective, drafter, model, teacher, optimizer, scheduler, train_plans, eval_plans, total_steps,
        device, dtype, attention, dist, Path(spec.work_dir), emit, source, accumulate,
    )  # fmt: skip
    state = TrainState()
    if spec.resume_from:
        state = load_checkpoint(Path(spec.resume_from), drafter, optimizer, scheduler)
        state.runs += 1
    return tr, state


def rows_per_step(cfg: TrainConfig, index: SampleIndex, world: int) -> int:
    """Rows each device accumulates per optimizer step: 1, or for `batch_sequences` the rows that hold
    that many samples of `index` on average (lengths cut at max_length), over `world` devices."""
    if cfg.batch_sequences is None or len(index) == 0:
        return 1
    mean_tokens = float(np.minimum(index.length, cfg.max_length).mean())
    return max(1, round(cfg.batch_sequences * mean_tokens / (cfg.batch_tokens * world)))


def cosine_with_warmup(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """lr multiplier: linear warm-up over warmup_ratio of the steps, then cosine down to min_lr_ratio."""
    warmup = round(cfg.warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _indices(spec: TrainSpec, source: DataSource | None = None) -> tuple[SampleIndex, SampleIndex]:
    """Train and eval sample indices; without an eval split, a seeded hold-out of the train samples.
    `train_fraction` < 1 keeps the first share of the train samples (after any hold-out). Online, the
    samples are the corpus rows, in the order the shards would hold them."""
    held_out: SampleIndex | None
    if isinstance(source, OnlineFeeder):
        train = source.index("train")
        if train is None:
            raise TrainingError("online training: the corpus has no train rows to extract")
        train_index, held_out = train, source.index("eval")
    else:
        train_index = SampleIndex([Path(p) for p in spec.train_shards])
        held_out = SampleIndex([Path(p) for p in spec.eval_shards]) if spec.eval_shards else None
    if held_out is not None:
        eval_index = held_out
    else:
        n = len(train_index)
        if n < 2:
            raise TrainingError(f"{n} training sample(s) and no eval split: nothing can be held out")
        held = min(spec.cfg.heldout_samples, max(1, n // 10))
        order = np.random.default_rng([spec.cfg.seed, 7]).permutation(n)
        train_index, eval_index = (
            train_index.subset(np.sort(order[held:])),
            train_index.subset(np.sort(order[:held])),
        )
    if spec.cfg.train_fraction < 1:
        keep = max(1, math.ceil(spec.cfg.train_fraction * len(train_index)))
        train_index = train_index.subset(np.arange(keep))
    return train_index, eval_index


def run_training(spec: TrainSpec, dist: DistInfo, emit: Emit) -> TrainState:
    """Build, restore if resuming, train. The entry point of both the in-process path and each worker."""
    started = time.perf_counter()
    tr, state = build_trainer(spec, dist, emit)
    try:
        tr.emit(
            {
                "kind": "start",
                "step": state.step,
                "total_steps": tr.total_steps,
                "world": dist.world,
                "rows_per_step": tr.accumulate,
            }
        )
        return train(tr, state, started)
    finally:
        tr.source.close()  # first: the figures then show each server's end
        if isinstance(tr.source, OnlineFeeder):
            tr.emit({"kind": "online", "rank": dist.rank, **tr.source.figures()})
