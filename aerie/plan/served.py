"""The served speed-up of an EAGLE-3 drafter, predicted before it is deployed.

One speculative round (k drafts, one verify of k+1 tokens, topk 1) yields `accept_length` tokens per
request in `round_ms`; plain decoding yields one in `step_ms`. So

    speed-up = accept_length x step_ms / round_ms,      break-even accept_length = round_ms / step_ms.

Both times are measured in SGLang with random weights per target shape, card and concurrency at several
step counts k, each repeated (`benchmarks/planner/spec_cost.py`, folded into `data/spec_cost.json`). The times
are fitted, not read off one cell, with a form that cannot contradict itself:

    round_ms(k, c) = a(c) + b(c) k,   a, b >= 0 (least squares over every repetition at every k),
    a(c), b(c), step_ms(c) non-decreasing in c (pooled adjacent violators over the measured levels),

so a longer chain or a larger batch never predicts a faster round, whatever noise a cell carried; the
fit's residuals give the uncertainty (`round_sd_ms`, and a speed-up interval from it). Between measured
levels a, b and the step time are interpolated in log(concurrency); between measured shapes in
log(active parameters). Nothing is extrapolated: a k or a concurrency outside the measured range gets
no speed-up, only the reason (`refused`); a shape outside the measured range, an unmeasured MoE, an
unmeasured card or an interpolated k or level is predicted and flagged (`flags`), and every printout says so.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import statistics
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from aerie.errors import ConfigError

log = logging.getLogger("aerie.plan")

DATA = Path(__file__).parent / "data" / "spec_cost.json"
# Architecture names of mixture-of-experts targets (their decode cost follows the experts a batch touches,
# not the active parameters alone, so they are predicted from the measured MoE only).
MOE_MARKERS = ("moe", "mixtral", "deepseek", "kimi", "gptoss", "gpt_oss", "dbrx", "jamba", "glm4moe")


@dataclass(frozen=True)
class Shape:
    """What the prediction needs of a target."""

    name: str
    active_params: float
    moe: bool


@dataclass(frozen=True)
class Prediction:
    concurrency: int
    num_steps: int
    step_ms: float
    round_ms: float
    accept_length: float | None
    # One standard deviation of the fitted times, from the repetitions' residuals (0 where one run each).
    step_sd_ms: float = 0.0
    round_sd_ms: float = 0.0
    # What was not measured as asked (interpolated k or level, another shape, card): printed beside it.
    flags: tuple[str, ...] = ()
    # Why no speed-up is given (k or concurrency outside what was measured); None = predicted.
    refused: str | None = None

    @property
    def break_even(self) -> float:
        """Tokens a round must yield to match plain decoding."""
        return self.round_ms / self.step_ms

    @property
    def speedup(self) -> float | None:
        if self.accept_length is None or self.refused:
            return None
        return self.accept_length / self.break_even

    @property
    def speedup_range(self) -> tuple[float, float] | None:
        """The speed-up with both times one standard deviation against it, then for it."""
        if self.speedup is None or self.accept_length is None:
            return None
        low = (
            self.accept_length
            * max(self.step_ms - self.step_sd_ms, 1e-6)
            / (self.round_ms + self.round_sd_ms)
        )
        high = (
            self.accept_length
            * (self.step_ms + self.step_sd_ms)
            / max(self.round_ms - self.round_sd_ms, 1e-6)
        )
        return low, high

    def record(self) -> dict[str, Any]:
        span = self.speedup_range
        return {
            "concurrency": self.concurrency,
            "num_steps": self.num_steps,
            "step_ms": round(self.step_ms, 4),
            "round_ms": round(self.round_ms, 4),
            "step_sd_ms": round(self.step_sd_ms, 4),
            "round_sd_ms": round(self.round_sd_ms, 4),
            "break_even_accept_length": round(self.break_even, 3),
            "accept_length": self.accept_length,
            "speedup": None if self.speedup is None else round(self.speedup, 3),
            "speedup_range": None if span is None else [round(span[0], 3), round(span[1], 3)],
            "flags": list(self.flags),
            "refused": self.refused,
        }

    def text(self) -> str:
        """The speed-up as printed: refused with its reason, or with its interval and flags."""
        if self.refused:
            return f"no speed-up predicted ({self.refused})"
        if self.speedup is None:
            return "-"
        span = self.speedup_range
        out = f"{self.speedup:.2f}x"
        if span is not None and span[1] - span[0] >= 0.01:
            out += f" ({span[0]:.2f}-{span[1]:.2f})"
        if self.flags:
            out += f" [NOT MEASURED: {'; '.join(self.flags)}]"
        return out


@dataclass(frozen=True)
class ServedEstimate:
    shape: Shape
    card: str
    measured_card: str
    basis: str
    source: str
    predictions: list[Prediction]
    # How the measurements' prediction compared with a speed-up SGLang served, where the record says.
    check: str | None = None
    # What holds for every level: the shape or card was not measured as such.
    flags: tuple[str, ...] = ()
    measured: dict[str, Any] | None = None

    def record(self) -> dict[str, Any]:
        return {
            "target": self.shape.name,
            "card": self.card,
            "measured_card": self.measured_card,
            "basis": self.basis,
            "source": self.source,
            "flags": list(self.flags),
            "measured": self.measured,
            "levels": [p.record() for p in self.predictions],
        }

    def summary(self) -> str:
        """One line: the predicted speed-up (or only the break-even) per level."""
        tau = next((p.accept_length for p in self.predictions if p.accept_length is not None), None)
        k = self.predictions[0].num_steps if self.predictions else 0
        parts = [f"c{p.concurrency} {p.text()}" for p in self.predictions]
        even = "/".join(f"{p.break_even:.2f}" for p in self.predictions)
        at = f"at accept length {tau:.2f}" if tau is not None else "no evaluated accept length"
        flagged = f" [NOT MEASURED: {'; '.join(self.flags)}]" if self.flags else ""
        return (
            f"predicted served speed-up (EAGLE-3 k={k}, {at}): {', '.join(parts)}; "
            f"pays above {even} tokens per round ({self.basis}; measured on {self.measured_card}){flagged}"
        )

    def lines(self) -> list[str]:
        """The estimate as the plan and the deploy stage print it."""
        on = (
            self.measured_card
            if self.card == self.measured_card
            else f"{self.measured_card}, for {self.card}"
        )
        k = self.predictions[0].num_steps if self.predictions else 0
        head = f"served speed-up with EAGLE-3 (k={k}, SGLang, measured on {on}; {self.basis}):"
        rows = [f"  NOT MEASURED: {flag}" for flag in self.flags]
        for p in self.predictions:
            if p.refused:
                rows.append(f"  c{p.concurrency}: no speed-up predicted ({p.refused})")
                continue
            sd = f" ±{p.round_sd_ms:.2f} ms" if p.round_sd_ms > 0 else " ms (no spread: one run a cell)"
            text = (
                f"  c{p.concurrency}: step {p.step_ms:.2f} ms, round {p.round_ms:.2f}{sd}: "
                f"pays above {p.break_even:.2f} accepted tokens per round"
            )
            if p.speedup is not None:
                text += f"; at {p.accept_length:.2f}: {p.text()}"
            elif p.flags:
                text += f" [NOT MEASURED: {'; '.join(p.flags)}]"
            rows.append(text)
        if self.measured:
            rows.append(f"  measured: k {self.measured['k']}, concurrency {self.measured['concurrency']}")
        check = [f"  checked: {self.check}"] if self.check else []
        return [head, *rows, *check, f"  ({self.source})"]


@cache
def _table() -> dict[str, Any]:
    if not DATA.exists():
        return {"cards": {}}
    return json.loads(DATA.read_text())  # type: ignore[no-any-return]


def is_moe(architecture: str) -> bool:
    arch = architecture.lower().replace("-", "")
    return any(m in arch for m in MOE_MARKERS)


def shape_of_target(target: Any) -> Shape:
    """A `TargetInfo` (the deploy stage) or `TargetFacts` (the plan) as a Shape: its active parameters
    and whether it routes experts, from its config's geometry; without one, from the weights' bytes
    (2 a parameter) and the architecture's name."""
    geometry = getattr(target, "geometry", None)
    if geometry is not None:
        return Shape(
            name=target.name, active_params=float(geometry.params()[1]), moe=geometry.moe is not None
        )
    active = getattr(target, "active_params", None)
    if active is None:
        active = target.size_bytes / 2
    arch = getattr(target, "architecture", "") or ""
    moe = is_moe(arch) or (getattr(target, "weight_bytes", 0) > 4 * float(active))
    return Shape(name=target.name, active_params=float(active), moe=moe)


# ---------------------------------------------------------------- the monotone fit


@dataclass(frozen=True)
class LevelFit:
    """One shape's times at one concurrency: step_ms, and round_ms = a + b k, with their spread."""

    concurrency: int
    step_ms: float
    step_sd_ms: float
    a: float
    b: float
    round_sd_ms: float

    def round_ms(self, k: float) -> float:
        return self.a + self.b * k


def fit_round(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(a, b, sd): least squares of round_ms = a + b k over (k, ms) points with a, b >= 0 (a round never
    gets faster with more drafts, and never costs less than nothing), and the residuals' standard
    deviation (0 with no more points than parameters)."""
    n = len(points)
    ks = [k for k, _ in points]
    ys = [y for _, y in points]
    mk, my = sum(ks) / n, sum(ys) / n
    sxx = sum((k - mk) ** 2 for k in ks)
    b = sum((k - mk) * (y - my) for k, y in points) / sxx if sxx > 0 else 0.0
    a = my - b * mk
    if b < 0:  # noise made the longer chain faster: the best monotone fit is flat
        a, b = my, 0.0
    if a < 0:  # through the origin
        a, b = 0.0, sum(k * y for k, y in points) / max(sum(k * k for k in ks), 1e-12)
    free = n - (2 if sxx > 0 else 1)
    sd = math.sqrt(sum((y - a - b * k) ** 2 for k, y in points) / free) if free > 0 else 0.0
    return a, b, sd


def _pooled(values: list[float], weights: list[float] | None = None) -> list[float]:
    """The closest non-decreasing sequence (pooled adjacent violators, weighted least squares)."""
    blocks: list[list[float]] = []  # [value, weight, count]
    for v, w in zip(values, weights or [1.0] * len(values), strict=True):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    out: list[float] = []
    for v, _, n in blocks:
        out += [v] * int(n)
    return out


def _samples(level: dict[str, Any]) -> tuple[list[float], list[tuple[float, float]]]:
    """A level's step times and (k, round time) points: every repetition where the record keeps them
    (`step_ms_reps`, `round_ms_reps`), else the one figure per cell."""
    steps = [float(x) for x in level.get("step_ms_reps") or [level["step_ms"]]]
    reps = level.get("round_ms_reps") or {}
    points = [(float(k), float(ms)) for k, one in level["round_ms"].items() for ms in (reps.get(k) or [one])]
    return steps, points


def fit_shape(levels: dict[str, Any]) -> list[LevelFit]:
    """The monotone fit of one shape's measured levels, ordered by concurrency."""
    cs = sorted(int(c) for c in levels)
    raw = []
    for c in cs:
        steps, points = _samples(levels[str(c)])
        a, b, sd = fit_round(points)
        mean = sum(steps) / len(steps)
        step_sd = statistics.stdev(steps) if len(steps) > 1 else 0.0
        raw.append((c, mean, step_sd, a, b, sd))
    steps_ms = _pooled([r[1] for r in raw])
    fixed = _pooled([r[3] for r in raw])
    per_draft = _pooled([r[4] for r in raw])
    return [LevelFit(c, steps_ms[i], raw[i][2], fixed[i], per_draft[i], raw[i][5]) for i, c in enumerate(cs)]


def measured_steps(levels: dict[str, Any]) -> list[int]:
    return sorted({int(k) for lvl in levels.values() for k in lvl["round_ms"]})


def _bracket(x: float, xs: list[float]) -> tuple[int, float] | None:
    """The point right of x and x's place between it and the one before, in log x; None at or past an
    end (or with one point), where the end value holds."""
    if len(xs) == 1 or x <= xs[0] or x >= xs[-1]:
        return None
    i = bisect.bisect_right(xs, x)
    return i, (math.log(x) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))


def _end(x: float, xs: list[float], ys: list[float]) -> float:
    return ys[0] if len(xs) == 1 or x <= xs[0] else ys[-1]


def _log_interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Linear in log x between the two points around x (x inside [xs[0], xs[-1]])."""
    if (at := _bracket(x, xs)) is None:
        return _end(x, xs, ys)
    i, t = at
    return ys[i - 1] + t * (ys[i] - ys[i - 1])


def _at_level(fits: list[LevelFit], c: int, k: int) -> tuple[float, float, float, float]:
    """(step, round, step sd, round sd) at concurrency c (inside the measured range) and k drafts."""
    xs = [float(f.concurrency) for f in fits]
    step = _log_interp(c, xs, [f.step_ms for f in fits])
    a = _log_interp(c, xs, [f.a for f in fits])
    b = _log_interp(c, xs, [f.b for f in fits])
    step_sd = _log_interp(c, xs, [f.step_sd_ms for f in fits])
    round_sd = _log_interp(c, xs, [f.round_sd_ms for f in fits])
    return step, a + b * k, step_sd, round_sd


def _geo(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise linear in (log x, log y) through the points; the end values outside them."""
    if (at := _bracket(x, xs)) is None:
        return _end(x, xs, ys)
    i, t = at
    if min(ys[i - 1], ys[i]) <= 0:  # a spread of zero (one run a cell): linear, not geometric
        return ys[i - 1] + t * (ys[i] - ys[i - 1])
    return math.exp(math.log(ys[i - 1]) + t * (math.log(ys[i]) - math.log(ys[i - 1])))


def _refusal(k: int, c: int, ks: list[int], cs: list[int]) -> str | None:
    if not ks or k < ks[0] or k > ks[-1]:
        return f"k={k} outside the measured {ks[0]}-{ks[-1]}" if ks else "no step count measured"
    if c < cs[0] or c > cs[-1]:
        return f"concurrency {c} outside the measured {cs[0]}-{cs[-1]}"
    return None


def _level_flags(k: int, c: int, ks: list[int], cs: list[int]) -> tuple[str, ...]:
    flags = []
    if k not in ks:
        flags.append(f"k={k} fitted between the measured k {','.join(map(str, ks))}")
    if c not in cs:
        flags.append(f"concurrency {c} interpolated between measured levels")
    return tuple(flags)


def estimate(
    shape: Shape,
    card: str,
    num_steps: int,
    concurrency: list[int],
    accept_length: float | dict[int, float] | None = None,
    table: dict[str, Any] | None = None,
) -> ServedEstimate:
    """Step and round times, break-even acceptance and (given the acceptance length, one for all levels or
    one per level) the served speed-up at each concurrency level. `table`: the measurements (default
    `data/spec_cost.json`)."""
    if num_steps < 1:
        raise ConfigError(f"num_steps {num_steps}: a speculative round drafts at least one token")
    if not concurrency or min(concurrency) < 1:
        raise ConfigError(f"concurrency {concurrency}: list positive levels")
    taus = accept_length if isinstance(accept_length, dict) else dict.fromkeys(concurrency, accept_length)
    for c, tau in taus.items():
        if tau is not None and not 1.0 <= tau <= num_steps + 1:
            raise ConfigError(
                f"accept length {tau} at concurrency {c}: a round of {num_steps} drafts yields between 1 "
                f"and {num_steps + 1} tokens"
            )
    cards = (table or _table())["cards"]
    if not cards:
        raise ConfigError(
            f"no speculative serving measurements in {DATA}: run benchmarks/planner/spec_cost.py"
        )
    measured = card if card in cards else next(iter(cards))
    entry = cards[measured]
    shapes = entry["shapes"]
    family = {n: s for n, s in shapes.items() if s["moe"] == shape.moe} or shapes
    ordered = sorted(family.items(), key=lambda kv: kv[1]["active_params"])
    xs = [s["active_params"] for _, s in ordered]
    names = [n for n, _ in ordered]
    fits = [fit_shape(s["levels"]) for _, s in ordered]
    # What every used shape measured: a k or level outside any of them is refused.
    ks = sorted(set.intersection(*(set(measured_steps(s["levels"])) for _, s in ordered)))
    cs = sorted(set.intersection(*({int(c) for c in s["levels"]} for _, s in ordered)))
    preds = []
    for c in concurrency:
        refused = _refusal(num_steps, c, ks, cs)
        at = [_at_level(f, min(max(c, cs[0]), cs[-1]), num_steps) for f in fits]
        values = [_geo(shape.active_params, xs, [p[i] for p in at]) for i in range(4)]
        preds.append(
            Prediction(
                c,
                num_steps,
                values[0],
                values[1],
                taus.get(c),
                step_sd_ms=values[2],
                round_sd_ms=values[3],
                flags=() if refused else _level_flags(num_steps, c, ks, cs),
                refused=refused,
            )
        )
    basis = _basis(shape, xs, names)
    flags = []
    if shape.moe and not any(s["moe"] for s in shapes.values()):
        basis += " (no MoE shape measured: a dense shape's times)"
        flags.append("an MoE target predicted from dense shapes")
    if "nearest" in basis or "between" in basis:  # not one of the measured shapes
        flags.append(f"the shape itself ({shape.active_params / 1e9:.2g}B active)")
    if measured != card:
        flags.append(f"card {card}: {measured}'s times")
    return ServedEstimate(
        shape=shape,
        card=card,
        measured_card=measured,
        basis=basis,
        source=f"benchmarks/results/{entry['source']}",
        predictions=preds,
        check=entry.get("check"),
        flags=tuple(flags),
        measured={"k": ks, "concurrency": cs},
    )


def _basis(shape: Shape, xs: list[float], names: list[str]) -> str:
    size = f"{shape.active_params / 1e9:.2g}B active"
    if len(xs) == 1 or shape.active_params <= xs[0] or shape.active_params >= xs[-1]:
        i = 0 if len(xs) == 1 or shape.active_params <= xs[0] else len(xs) - 1
        if math.isclose(shape.active_params, xs[i], rel_tol=0.05):
            return f"{size}, the measured {names[i]} shape"
        return f"{size}, taken as the nearest measured shape {names[i]}"
    i = bisect.bisect_right(xs, shape.active_params)
    for j in (i - 1, i):
        if math.isclose(shape.active_params, xs[j], rel_tol=0.05):
            return f"{size}, the measured {names[j]} shape"
    return f"{size}, between the measured {names[i - 1]} and {names[i]}"


def evaluated_accept_length(figures: dict[str, Any], num_steps: int) -> tuple[float, str] | None:
    """The evaluated EAGLE-3 acceptance length at this step count from the evaluate stage's figures
    (`accept_<dataset>_eagle3_k<steps>`, greedy), MT-Bench's when measured, and its key."""
    suffix = f"_eagle3_k{num_steps}"
    found = {
        k: float(v)
        for k, v in figures.items()
        if k.startswith("accept_") and k.endswith(suffix) and isinstance(v, int | float)
    }
    if not found:
        return None
    key = next((k for k in sorted(found) if k.startswith("accept_mtbench_")), sorted(found)[0])
    return found[key], key


# Acceptance lengths the plan shows the speed-up at: before a drafter exists only the break-even is known.
PLAN_ACCEPT_LENGTHS = (2.0, 3.0)


def for_plan(
    target: Any, hardware: str, gpu: bool, num_steps: int, concurrency: list[int], tp_size: int = 1
) -> list[str]:
    """The plan's lines: break-even acceptance per level for the preset's target and deploy settings, and
    the speed-up at a few acceptance lengths (the evaluated one is known only after training). Every
    shape was measured on one GPU: a target served over several is flagged."""
    if not gpu:
        return [
            f"served speed-up: not predicted on {hardware} (SGLang's speculative serving is measured on GPUs)"
        ]
    try:
        est = estimate(shape_of_target(target), hardware, num_steps, concurrency)
    except ConfigError as exc:
        return [f"served speed-up: not predicted ({exc})"]
    if tp_size > 1:
        est = replace(est, flags=(*est.flags, f"tensor parallel {tp_size} (every shape measured on one GPU)"))
    lines = est.lines()
    for p in est.predictions:
        if p.refused:
            lines.append(f"  c{p.concurrency}: no speed-up predicted ({p.refused})")
            continue
        flags = [*est.flags, *p.flags]
        note = f" [NOT MEASURED: {'; '.join(flags)}]" if flags else ""
        at = ", ".join(
            f"{tau:g}: {tau / p.break_even:.2f}x" for tau in PLAN_ACCEPT_LENGTHS if tau <= num_steps + 1
        )
        lines.append(f"  c{p.concurrency} speed-up at accept length {at}{note}")
    return lines


def this_card() -> str | None:
    """The GPU this process sees, when torch is already loaded (the deploy stage's process): 'h100',
    'h200', ...; None when unknown. torch is not imported for this alone."""
    import sys

    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_available():
            return None
        name = str(torch.cuda.get_device_name(0))
    except Exception:  # a broken driver must not stop a deployment over a printout
        return None
    return next((c for c in ("h200", "h100", "a100", "b200") if c in name.lower()), None)


def for_deploy(
    target: Any, num_steps: int, concurrency: list[int], evaluation_figures: dict[str, Any] | None
) -> ServedEstimate | None:
    """The deploy stage's prediction before it serves: the evaluated acceptance length at the served step
    count, mapped to the served one (`served_accept_length`; None when no evaluation measured it: then
    only the break-even)."""
    found = evaluated_accept_length(evaluation_figures or {}, num_steps)
    # The offline accept length runs above the served one (fp32, longer answers): mapped to served.
    tau = None if found is None else min(max(served_accept_length(found[0])[0], 1.0), num_steps + 1.0)
    try:
        return estimate(shape_of_target(target), this_card() or "h200", num_steps, concurrency, tau)
    except ConfigError:  # no measurements to predict from: the deployment measures anyway
        return None


def before_deploy(deploy: Any, target: Any, evaluation: Any) -> ServedEstimate | None:
    """Logged by the composer before the deploy stage serves: the speed-up the measured step and round
    times predict for this target at the evaluated acceptance length (`evaluation`: the evaluate stage's
    result, None when it did not run)."""
    predicted = for_deploy(
        target, deploy.num_steps, deploy.concurrency, evaluation.figures if evaluation else None
    )
    if predicted is not None:
        log.info("deploy: %s", predicted.summary())
    return predicted


def after_deploy(predicted: ServedEstimate | None, results: list[Any]) -> list[Any]:
    """The deploy stage's results with the prediction among their figures, beside the measured speed-up
    (`predicted_speedup_c<level>`)."""
    if predicted is None:
        return results
    extra = {
        f"predicted_speedup_c{p.concurrency}": None if p.speedup is None else round(p.speedup, 3)
        for p in predicted.predictions
    }
    return [r.model_copy(update={"figures": {**r.figures, **extra}}) for r in results]


ACCEPTANCE_MAP = Path(__file__).parent / "data" / "served_acceptance.json"


@cache
def _acceptance_map() -> dict[str, Any] | None:
    return json.loads(ACCEPTANCE_MAP.read_text()) if ACCEPTANCE_MAP.exists() else None


def served_accept_length(offline: float) -> tuple[float, str]:
    """The accept length a drafter is expected to reach served, from the offline one (fp32, longer
    answers, teacher-forced prompts): served - 1 = slope x (offline - 1), the slope fitted to the pairs
    on record (`benchmarks/planner/served.py acceptance-map`), and how good that map is. Without a map: the
    offline one, said so."""
    found = _acceptance_map()
    if not found:
        return offline, "offline accept length (no offline-to-served map on record)"
    served = 1.0 + found["slope"] * (offline - 1.0)
    return served, (
        f"offline {offline:.2f} mapped to served {served:.2f} (slope {found['slope']:.3f} from "
        f"{found['pairs_used']} pairs on record, residual sd {found['residual_sd']:.2f} tokens)"
    )
