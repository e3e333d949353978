"""This machine's speed now, beside that of the machine the CPU rates were tied to.

The CPU stages' rates are calibrated on one machine (`benchmarks/plan_accuracy.py --calibrate`, two short
runs), which records its fp32 matrix-multiply rate. A plan for the CPU measures the same rate here, in a
fraction of a second, and says how far apart the two are. It does not rescale the estimates by it: the
stages that decode a token at a time follow memory latency more than the multiply rate, so the figure is
a warning to recalibrate, not a factor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cache

from aerie.plan.facts import Rate

PROBE_SIZE = 1024  # a 2-GFLOP product: tens of milliseconds on a laptop core
PROBE_REPEATS = 5  # the best of these: the machine's rate, not its neighbours' load
FAR = 1.25  # apart by more than this either way, the plan says to recalibrate


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


@dataclass(frozen=True)
class MachineSpeed:
    gflops_now: float
    gflops_calibrated: float
    source: str

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
        if self.far:
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
    return MachineSpeed(gemm_gflops(), calibrated.value, calibrated.source)
