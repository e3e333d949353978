"""`aerie plan` sets each throughput beside its roofline: the stage's rate times the work of a token (the
target's active parameters, the drafter's step) against the devices' peak FLOP/s, and shard writes against
the disk's measured rate. The printed fraction is recomputed from the printed rate, work and peak, and a
rate that claims more than its roofline fails."""

from __future__ import annotations

import re

import pytest

from aerie.plan import make_plan
from aerie.plan.render import table
from aerie.presets import load_config

LINE = re.compile(
    r"(?P<rate>[\d,]+) (?:tokens|positions)/s x (?P<gflop>[\d.]+) GFLOP each = (?P<share>[\d.]+)% of "
    r"(?P<devices>\d+) x (?P<peak>[\d,.]+) (?P<unit>[TG])FLOP/s"
)
DISK = re.compile(
    r"shard writes (?P<wrote>[\d,]+) MB/s = (?P<share>\d+)% of the disk's measured (?P<disk>[\d,]+) MB/s"
)


def number(text: str) -> float:
    return float(text.replace(",", ""))


@pytest.mark.parametrize(
    ("preset", "hardware", "stages"),
    [
        ("smollm2-local", "cpu", {"generate", "extract", "train"}),
        ("smollm2-gpu", "h200", {"generate", "extract", "train"}),
        ("kimi-k2.5-8gpu", "h200", {"extract", "train"}),  # generation through an API: no GPU to bound it
    ],
)
def test_each_throughput_is_printed_beside_its_roofline(preset: str, hardware: str, stages: set[str]) -> None:
    printed = table(make_plan(load_config(preset, []), hardware))
    section = printed.split("\nrooflines ", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    found = {line.split(":", 1)[0].strip(): line for line in section}
    assert set(found) == stages, printed
    for stage, line in found.items():
        m = LINE.search(line)
        assert m, line
        peak = number(m["peak"]) * (1e12 if m["unit"] == "T" else 1e9) * int(m["devices"])
        share = number(m["rate"]) * float(m["gflop"]) * 1e9 / peak
        assert share * 100 == pytest.approx(float(m["share"]), rel=0.02, abs=0.06), line
        assert 0 < share <= 1, f"{stage} claims more than its roofline: {line}"
        disk = DISK.search(line)
        if disk:
            assert number(disk["wrote"]) / number(disk["disk"]) * 100 == pytest.approx(
                float(disk["share"]), abs=1
            )
