"""The plan as the terminal (and the pipeline's first artifact) shows it."""

from __future__ import annotations

from aerie.plan import online, served
from aerie.plan.plan import Plan


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def nbytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:.0f} B"


def table(plan: Plan) -> str:
    s, cfg = plan.sizes, plan.cfg
    lines = [
        f"aerie plan '{cfg.run}' ({cfg.preset}) on {plan.hardware.name} ({plan.hardware.description}); "
        f"target {plan.target.name} (facts from {plan.target.source})",
    ]
    if plan.machine is not None:
        lines.append(("WARNING " if plan.machine.far else "") + "machine: " + plan.machine.line())
    lines += ["", "sizes"]
    for d in s.datasets:
        what = "regenerated" if d.regenerate else "kept as is"
        lines.append(
            f"  {d.name}: {d.conversations:,} conversations, {d.turns:,} turns {what}; "
            f"{d.prompt_tokens:,} prompt + {d.completion_tokens:,} completion tokens (max_tokens {d.max_tokens})"
        )
    share = s.supervised_tokens / max(1, s.corpus_tokens)
    lines += [
        f"  corpus: {s.corpus_records:,} records, {s.corpus_tokens:,} tokens, {share:.0%} supervised; "
        f"{s.train_tokens:,} tokens trained ({cfg.train.epochs:g} epochs)",
        f"  {s.chars_per_token:.2f} characters per token, {s.chars_per_token_source}",
        "",
        f"API cost: {'$' + format(plan.cost.total_usd, ',.2f') if plan.cost.total_usd is not None else 'unknown'} ({plan.cost.note})",
        "",
        f"{'stage':10s} {'time':>9s} {'GPUs':>5s} {'GPU time':>9s}  model",
    ]
    for st in plan.stages:
        lines.append(
            f"{st.stage:10s} {duration(st.seconds):>9s} {st.gpus:>5d} {duration(st.gpu_seconds):>9s}  {st.formula}"
        )
    lines.append(
        f"{'total':10s} {duration(plan.seconds):>9s} {'':>5s} {duration(plan.gpu_seconds):>9s}  wall-clock, stages one after another"
    )
    bounds = [f"  {st.stage}: {st.roofline}" for st in plan.stages if st.roofline]
    if bounds:
        lines += [
            "",
            "rooflines (each rate against its hardware's peak FLOP/s, and shards against the disk)",
            *bounds,
        ]
    lines += ["", "disk (at its fullest)"]
    for loc in plan.disk.locations:
        free = f", {nbytes(loc.free)} free" if loc.free is not None else ", not measurable here"
        parts = ", ".join(f"{k} {nbytes(v)}" for k, v in loc.parts.items() if v)
        flag = "  SHORT" if loc.short else ""
        lines.append(f"  {loc.name}: {nbytes(loc.need)}{free} ({parts}){flag}")
    if plan.disk.s3_bytes:
        lines.append(f"  S3: {nbytes(plan.disk.s3_bytes)} in about {plan.disk.s3_requests:,} requests")
    dep = cfg.deploy
    lines += [
        "",
        *served.for_plan(
            plan.target,
            plan.hardware.name,
            plan.hardware.gpu,
            dep.num_steps,
            dep.concurrency,
            cfg.server.tp_size,
        ),
    ]
    lines += online.lines(plan)
    notes = sorted({n for st in plan.stages for n in st.assumptions})
    cites = sorted({c for st in plan.stages for c in st.calibrated_by})
    if notes:
        lines += ["", "assumptions"] + [f"  - {n}" for n in notes]
    if cites:
        lines += ["", "measured rates used"] + [f"  - {c}" for c in cites]
    if plan.refusals:
        lines += ["", "cannot fit"] + [f"  - {type(r).__name__}: {r}" for r in plan.refusals]
    return "\n".join(lines)
