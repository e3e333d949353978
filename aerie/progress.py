"""Progress reporting shared by every stage: a callback of (fraction done, message).

Stages call it; the terminal gets a tqdm bar (`terminal_progress`), Prefect flows pass a callback
that updates a progress artifact. A stage never imports either.
"""

from __future__ import annotations

from collections.abc import Callable

ProgressFn = Callable[[float, str], None]


def no_progress(fraction: float, message: str) -> None:
    """The default callback: report nothing."""


def terminal_progress(desc: str) -> ProgressFn:
    """A tqdm bar (on stderr) driven by fractions in [0, 1]."""
    from tqdm import tqdm

    bar = tqdm(total=1000, desc=desc, unit="‰", leave=True)
    last: list[object] = [None]

    def update(fraction: float, message: str) -> None:
        target = int(max(0.0, min(1.0, fraction)) * 1000)
        if (target, message) == last[0]:
            return  # nothing new: a redraw would only repeat the line in a log file
        last[0] = (target, message)
        bar.update(target - bar.n)
        bar.set_postfix_str(message[:60], refresh=True)
        if target >= 1000:
            bar.close()

    return update


def close_terminal_bars() -> None:
    """Close the bars a failed stage left open, so that an error printed next starts its own line
    instead of trailing the last bar's."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
