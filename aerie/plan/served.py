"""The served speed-up of an EAGLE-3 drafter, predicted before it is deployed.

One speculative round (k drafts, one verify of k+1 tokens, topk 1) yields `accept_length` tokens per
request in `round_ms`; plain decoding yields one in `step_ms`. So

    speed-up = accept_length x step_ms / round_ms,      break-even accept_length = round_ms / step_ms.

Both times were measured in SGLang with random weights for three dense target shapes from 135M to 8B, at
concurrency 1, 8 and 32, with k = 3 and 7 (`benchmarks/spec_cost.py`, folded into `data/spec_cost.json`);
no MoE shape has been measured (the one in the script's list was left out by its time budget). A target
between two measured dense shapes takes both times interpolated in log(active parameters); one outside
the range takes the nearest shape's; an MoE target takes a measured MoE's where one is in the data, and
otherwise the dense shapes' times, and the prediction says so. Other k are
interpolated (or extended) linearly in k, other concurrency levels in log(concurrency). A card without
measurements takes the measured card's figures, and the prediction says so.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
from dataclasses import dataclass
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

    @property
    def break_even(self) -> float:
        """Tokens a round must yield to match plain decoding."""
        return self.round_ms / self.step_ms

    @property
    def speedup(self) -> float | None:
        return None if self.accept_length is None else self.accept_length / self.break_even

    def record(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "num_steps": self.num_steps,
            "step_ms": round(self.step_ms, 4),
            "round_ms": round(self.round_ms, 4),
            "break_even_accept_length": round(self.break_even, 3),
            "accept_length": self.accept_length,
            "speedup": None if self.speedup is None else round(self.speedup, 3),
        }


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

    def record(self) -> dict[str, Any]:
        return {
            "target": self.shape.name,
            "card": self.card,
            "measured_card": self.measured_card,
            "basis": self.basis,
            "source": self.source,
            "levels": [p.record() for p in self.predictions],
        }

    def summary(self) -> str:
        """One line: the predicted speed-up (or only the break-even) per level."""
        tau = next((p.accept_length for p in self.predictions if p.accept_length is not None), None)
        k = self.predictions[0].num_steps if self.predictions else 0
        parts = [
            f"c{p.concurrency} {p.speedup:.2f}x" if p.speedup is not None else f"c{p.concurrency} -"
            for p in self.predictions
        ]
        even = "/".join(f"{p.break_even:.2f}" for p in self.predictions)
        at = f"at accept length {tau:.2f}" if tau is not None else "no evaluated accept length"
        return (
            f"predicted served speed-up (EAGLE-3 k={k}, {at}): {', '.join(parts)}; "
            f"pays above {even} tokens per round ({self.basis}; measured on {self.measured_card})"
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
        rows = []
        for p in self.predictions:
            text = (
                f"  c{p.concurrency}: step {p.step_ms:.2f} ms, round {p.round_ms:.2f} ms: pays above "
                f"{p.break_even:.2f} accepted tokens per round"
            )
            if p.speedup is not None:
                text += f"; at {p.accept_length:.2f}: {p.speedup:.2f}x"
            rows.append(text)
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


def _interp(x: float, xs: list[float], ys: list[float], log_x: bool = True) -> float:
    """Piecewise linear in (log x, log y) through the points; the end values outside them."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    fx = (lambda v: math.log(v)) if log_x else (lambda v: v)
    t = (fx(x) - fx(xs[i - 1])) / (fx(xs[i]) - fx(xs[i - 1]))
    return math.exp(math.log(ys[i - 1]) + t * (math.log(ys[i]) - math.log(ys[i - 1])))


def _round_at(rounds: dict[str, float], k: int) -> float:
    """A round's time at k drafts: linear in k through the measured step counts (each draft step adds one
    small forward; the verify grows by one token)."""
    ks = sorted(int(s) for s in rounds)
    if len(ks) == 1:
        return rounds[str(ks[0])]
    lo, hi = (ks[0], ks[1]) if k <= ks[0] else (ks[-2], ks[-1])
    for a, b in zip(ks, ks[1:], strict=False):
        if a <= k <= b:
            lo, hi = a, b
    slope = (rounds[str(hi)] - rounds[str(lo)]) / (hi - lo)
    return max(rounds[str(lo)] + slope * (k - lo), 1e-3)


def _at_level(levels: dict[str, Any], c: int, k: int) -> tuple[float, float]:
    cs = sorted(int(x) for x in levels)
    steps = [levels[str(x)]["step_ms"] for x in cs]
    rounds = [_round_at(levels[str(x)]["round_ms"], k) for x in cs]
    fc = [float(x) for x in cs]
    return _interp(c, fc, steps), _interp(c, fc, rounds)


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
        raise ConfigError(f"no speculative serving measurements in {DATA}: run benchmarks/spec_cost.py")
    measured = card if card in cards else next(iter(cards))
    entry = cards[measured]
    shapes = entry["shapes"]
    family = {n: s for n, s in shapes.items() if s["moe"] == shape.moe} or shapes
    ordered = sorted(family.items(), key=lambda kv: kv[1]["active_params"])
    xs = [s["active_params"] for _, s in ordered]
    names = [n for n, _ in ordered]
    preds = []
    for c in concurrency:
        pairs = [_at_level(s["levels"], c, num_steps) for _, s in ordered]
        step = _interp(shape.active_params, xs, [p[0] for p in pairs])
        rnd = _interp(shape.active_params, xs, [p[1] for p in pairs])
        preds.append(Prediction(c, num_steps, step, rnd, taus.get(c)))
    basis = _basis(shape, xs, names)
    if shape.moe and not any(s["moe"] for s in shapes.values()):
        basis += " (no MoE shape measured: a dense shape's times)"
    return ServedEstimate(
        shape=shape,
        card=card,
        measured_card=measured,
        basis=basis,
        source=f"benchmarks/results/{entry['source']}",
        predictions=preds,
        check=entry.get("check"),
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


def for_plan(target: Any, hardware: str, gpu: bool, num_steps: int, concurrency: list[int]) -> list[str]:
    """The plan's lines: break-even acceptance per level for the preset's target and deploy settings, and
    the speed-up at a few acceptance lengths (the evaluated one is known only after training)."""
    if not gpu:
        return [
            f"served speed-up: not predicted on {hardware} (SGLang's speculative serving is measured on GPUs)"
        ]
    try:
        est = estimate(shape_of_target(target), hardware, num_steps, concurrency)
    except ConfigError as exc:
        return [f"served speed-up: not predicted ({exc})"]
    lines = est.lines()
    for p in est.predictions:
        at = ", ".join(
            f"{tau:g}: {tau / p.break_even:.2f}x" for tau in PLAN_ACCEPT_LENGTHS if tau <= num_steps + 1
        )
        lines.append(f"  c{p.concurrency} speed-up at accept length {at}")
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
    count (None when no evaluation measured it: then only the break-even)."""
    found = evaluated_accept_length(evaluation_figures or {}, num_steps)
    tau = None if found is None else min(max(found[0], 1.0), num_steps + 1.0)
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
