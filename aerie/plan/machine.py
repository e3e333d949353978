"""This machine's speed now, beside that of the machine the CPU rates were tied to.

The CPU stages' rates are calibrated on one machine (`benchmarks/planner/plan_accuracy.py --calibrate`, two short
runs), which records its fp32 matrix-multiply rate. A plan for the CPU measures the same rate here, in
half a second, and says how far apart the two are. It does not rescale the estimates by it: the
stages that decode a token at a time follow memory latency more than the multiply rate, so the figure is
a warning to recalibrate, not a factor. Other work on the cores slows the probe too: it measures how much
of them other processes used meanwhile, and a slow reading taken while they were busy says to plan again
when they are idle first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cache
from typing import Any

from aerie.plan.facts import Rate

PROBE_SIZE = 1024  # a 2-GFLOP product: tens of milliseconds on a laptop core
PROBE_REPEATS = 5  # the best of at least these: the machine's rate, not its neighbours' load
PROBE_MIN_S = 0.5  # ...and of at least this long: enough clock ticks to see what else ran meanwhile
FAR = 1.25  # apart by more than this either way, the plan says to recalibrate
BUSY = 0.25  # other work's share of the cores during the probe above which it may have slowed it


@cache
def _probe() -> tuple[float, float]:
    """(fp32 matrix-multiply GFLOP/s of this machine now, the share of its cores that other processes and
    the hypervisor used while it ran): numpy's BLAS on every core, once per process."""
    import numpy as np
    import psutil

    rng = np.random.default_rng(0)
    a = rng.standard_normal((PROBE_SIZE, PROBE_SIZE), dtype=np.float32)
    b = rng.standard_normal((PROBE_SIZE, PROBE_SIZE), dtype=np.float32)
    a @ b  # the first product starts the BLAS threads
    me = psutil.Process()
    machine_before, mine_before, start = psutil.cpu_times(), me.cpu_times(), time.perf_counter()
    best, runs = float("inf"), 0
    while runs < PROBE_REPEATS or time.perf_counter() - start < PROBE_MIN_S:
        t = time.perf_counter()
        a @ b
        best, runs = min(best, time.perf_counter() - t), runs + 1
    wall = time.perf_counter() - start
    machine_after, mine_after = psutil.cpu_times(), me.cpu_times()
    busy = _busy(machine_after) - _busy(machine_before)
    mine = (mine_after.user + mine_after.system) - (mine_before.user + mine_before.system)
    others = max(0.0, busy - mine) / (wall * (psutil.cpu_count() or 1))
    return 2 * PROBE_SIZE**3 / best / 1e9, min(1.0, others)


def _busy(times: Any) -> float:
    """Seconds psutil's `cpu_times()` counts the cores as working: not idle, not waiting on disk (the
    hypervisor's steal included; guest time is inside user time already)."""
    not_working = ("idle", "iowait", "guest", "guest_nice")
    return float(sum(times) - sum(getattr(times, name, 0.0) for name in not_working))


def gemm_gflops() -> float:
    """fp32 matrix-multiply GFLOP/s of this machine now (measured once per process)."""
    return _probe()[0]


def others_share() -> float:
    """The share of the cores other work used while `gemm_gflops` measured: what may have slowed it."""
    return _probe()[1]


@dataclass(frozen=True)
class MachineSpeed:
    gflops_now: float
    gflops_calibrated: float
    source: str
    others_share: float = 0.0

    @property
    def ratio(self) -> float:
        return self.gflops_now / self.gflops_calibrated

    @property
    def far(self) -> bool:
        return not 1 / FAR <= self.ratio <= FAR

    def line(self) -> str:
        said = (
            f"fp32 matrix multiply at {self.gflops_now:.0f} GFLOP/s here now, {self.gflops_calibrated:.0f} on "
            f"the machine the CPU rates were calibrated on ({self.source}): {self.ratio:.2f}x"
        )
        if self.far and self.ratio < 1 and self.others_share > BUSY:
            said += (
                f"; more than {FAR - 1:.0%} apart, but other work used {self.others_share:.0%} of the cores "
                "meanwhile, which slows the probe: plan again when they are idle, and recalibrate on this "
                "machine if it still reads slow"
            )
        elif self.far:
            said += (
                f"; more than {FAR - 1:.0%} apart, so the CPU estimates below may be off by as much: "
                "recalibrate on this machine (benchmarks/planner/plan_accuracy.py --calibrate, two short runs)"
            )
        return said


def machine_speed(measured: dict[str, Rate]) -> MachineSpeed | None:
    """This machine against the calibration's, when the rates name the calibration machine's speed."""
    calibrated = measured.get("calibration_gemm_gflops")
    if calibrated is None or calibrated.value <= 0:
        return None
    return MachineSpeed(gemm_gflops(), calibrated.value, calibrated.source, others_share())
