"""Progress reporting shared by every stage: a callback of (fraction done, message).

Stages call it; the terminal gets a tqdm bar (`terminal_progress`), Prefect flows pass a callback
that updates a progress artifact. A stage never imports either.
"""

from __future__ import annotations

from collections.abc import Callable

ProgressFn = Callable[[float, str], None]
# A ProgressFn per result name (`merge`, `generate-sharegpt`): one bar or artifact each.
ProgressFactory = Callable[[str], ProgressFn]


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


def eta_text(elapsed_s: float, fraction: float) -> str:
    """`12.0% in 1m05s, ~8m00s left` from the time spent and the share done (the rate so far)."""
    if fraction <= 0:
        return f"0% after {_clock(elapsed_s)}"
    left = elapsed_s * (1.0 - fraction) / fraction
    return f"{fraction * 100:.1f}% in {_clock(elapsed_s)}, ~{_clock(left)} left"


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def close_terminal_bars() -> None:
    """Close the bars a failed stage left open, so that an error printed next starts its own line
    instead of trailing the last bar's."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
