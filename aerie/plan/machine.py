"""This machine's speed now, beside that of the machine the CPU rates were tied to.

The CPU stages' rates are calibrated on one machine (`benchmarks/plan_accuracy.py --calibrate`, two short
runs), which records its fp32 matrix-multiply rate. A plan for the CPU measures the same rate here, in a
fraction of a second, and says how far apart the two are. It does not rescale the estimates by it: the
stages that decode a token at a time follow memory latency more than the multiply rate, so the figure is
a warning to recalibrate, not a factor. Other work on the cores slows the probe too, so a slow reading
taken while they were busy says to plan again when they are idle first.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import cache

from aerie.plan.facts import Rate

PROBE_SIZE = 1024  # a 2-GFLOP product: tens of milliseconds on a laptop core
PROBE_REPEATS = 5  # the best of these: the machine's rate, not its neighbours' load
FAR = 1.25  # apart by more than this either way, the plan says to recalibrate
BUSY = 0.5  # a load average per core above this: other work shared the cores the probe timed


@cache
def gemm_gflops() -> float:
    """fp32 matrix-multiply GFLOP/s of this machine now (numpy's BLAS on every core; once per process)."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((PROBE_SIZE, PROBE_SIZE), dtype=np.float32)
    b = rng.standard_normal((PROBE_SIZE, PROBE_SIZE), dtype=np.float32)
    a @ b  # the first product starts the BLAS threads
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * PROBE_SIZE**3 / best / 1e9


def load_per_core() -> float:
    """The last minute's load average per core: how much other work the probe shared the cores with."""
    return os.getloadavg()[0] / (os.cpu_count() or 1)


@dataclass(frozen=True)
class MachineSpeed:
    gflops_now: float
    gflops_calibrated: float
    source: str
    load_per_core: float = 0.0

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
        if self.far and self.ratio < 1 and self.load_per_core > BUSY:
            said += (
                f"; more than {FAR - 1:.0%} apart, but the cores were busy (load {self.load_per_core:.1f} a "
                "core over the last minute), which slows the probe: plan again when they are idle, and "
                "recalibrate on this machine if it still reads slow"
            )
        elif self.far:
            said += (
                f"; more than {FAR - 1:.0%} apart, so the CPU estimates below may be off by as much: "
                "recalibrate on this machine (benchmarks/plan_accuracy.py --calibrate, two short runs)"
            )
        return said


def machine_speed(measured: dict[str, Rate]) -> MachineSpeed | None:
    """This machine against the calibration's, when the rates name the calibration machine's speed."""
    calibrated = measured.get("calibration_gemm_gflops")
    if calibrated is None or calibrated.value <= 0:
        return None
    return MachineSpeed(gemm_gflops(), calibrated.value, calibrated.source, load_per_core())
