"""Acceptance by position in the output: does the drafter keep up deep into a long answer?

A drafter trained on rows of at most `train.max_length` tokens has never seen a position past it, and a
thinking target writes many thousands of tokens a turn: acceptance averaged over a whole output hides a
drafter that is good on the first 512 tokens and poor after 8K. Each verify round is put in the bucket
of where in the output its first token goes (`SpecOutput.rounds`); the buckets partition the rounds, so
their rounds and tokens add up to the whole measurement's and the overall acceptance length is their
round-weighted mean.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aerie.engine.speculative.decoder import SpecOutput

# Output-position buckets [start, end) in tokens; the last is open.
BUCKETS: tuple[tuple[int, int | None], ...] = ((0, 512), (512, 2048), (2048, 8192), (8192, None))


def bucket_name(start: int, end: int | None) -> str:
    """'0-512', '512-2K', '2K-8K', '8K+'."""

    def short(n: int) -> str:
        return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)

    return f"{short(start)}+" if end is None else f"{short(start)}-{short(end)}"


NAMES = tuple(bucket_name(s, e) for s, e in BUCKETS)
Buckets = tuple[tuple[int, int | None], ...]


def bucket_of(position: int, buckets: Buckets = BUCKETS) -> int:
    """Index in `buckets` of an output position."""
    for i, (start, end) in enumerate(buckets):
        if position >= start and (end is None or position < end):
            return i
    raise ValueError(f"output position {position} is in no bucket of {buckets}")


class PositionCounts:
    """Verify rounds and the tokens they emitted, by the output position where each round started."""

    def __init__(self, buckets: Buckets = BUCKETS) -> None:
        self.buckets = buckets
        self.rounds = [0] * len(buckets)
        self.tokens = [0] * len(buckets)

    def add(self, out: SpecOutput) -> None:
        for (start, _), emitted in zip(out.rounds, out.round_tokens(), strict=True):
            i = bucket_of(start, self.buckets)
            self.rounds[i] += 1
            self.tokens[i] += emitted

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Per bucket (by name, in order): its bounds, rounds, tokens and acceptance length (tokens per
        verify round, bonus included, as `SpecStats.accept_length`; None where no round started)."""
        return {
            bucket_name(start, end): {
                "start": start,
                "end": end,
                "rounds": self.rounds[i],
                "tokens": self.tokens[i],
                "accept_length": round(self.tokens[i] / self.rounds[i], 4) if self.rounds[i] else None,
            }
            for i, (start, end) in enumerate(self.buckets)
        }


def position_table(results: list[dict[str, Any]]) -> list[str]:
    """Markdown: acceptance length per output-position bucket, a row per measurement (rounds in brackets)."""
    rows = [r for r in results if r.get("acceptance_by_position")]
    if not rows:
        return []
    lines = [
        "## Acceptance length by position in the output",
        "",
        "Each verify round counts in the bucket of the output position where it starts (tokens); "
        "rounds in brackets, `-` where no output was that long.",
        "",
        "| dataset | proposer | steps | T | " + " | ".join(NAMES) + " |",
        "|---|---|---|---|" + "---|" * len(NAMES),
    ]
    for r in rows:
        cells = []
        for name in NAMES:
            b = r["acceptance_by_position"][name]
            cells.append("-" if b["accept_length"] is None else f"{b['accept_length']:.2f} ({b['rounds']})")
        lines.append(
            f"| {r['dataset']} | {r['proposer']} | {r['num_steps']} | {r.get('temperature') or 0:g} | "
            + " | ".join(cells)
            + " |"
        )
    return [*lines, ""]
