"""One case of the fault matrix (tests/faults/matrix.py) as it is recorded, and the helpers its case
modules share."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.fault_check import Verdict

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Case:
    case: str
    survived: bool  # fired, handled as expected, and the final state equal to an unfaulted run's
    fired: bool  # the fault happened (a counter from the fault server or the injector says so)
    fault: str  # what was injected, with that counter
    detect_s: float | None  # fault -> error surfaced; null where the fault is absorbed
    lost: int
    duplicates: int
    changed: int
    extra: int
    handled: bool  # the case's own expectation (refused, absorbed, the right exit status and line)
    message: str  # the error the user saw, or what absorbed the fault
    compared: str  # the final state against an unfaulted run's: counts and the first differences
    wall_s: float = 0.0
    path: str = "no-prefect"  # how the run went: `no-prefect` (in one process) or `prefect` (flows, subflows)

    @classmethod
    def of(
        cls,
        fired: bool,
        fault: str,
        detect_s: float | None,
        verdict: Verdict,
        message: str,
        handled: bool = True,
    ) -> Case:
        return cls(
            case="",
            survived=fired and handled and verdict.equal,
            fired=fired,
            fault=fault,
            detect_s=None if detect_s is None else round(detect_s, 3),
            lost=verdict.lost,
            duplicates=verdict.duplicated,
            changed=verdict.changed,
            extra=verdict.extra,
            handled=handled,
            message=message[:600],
            compared=verdict.summary()[:600],
        )


def first_line(exc: BaseException | str) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:400] if lines else type(exc).__name__


def wait_until(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out waiting")
        time.sleep(0.05)
