"""The summary `make run` ends with: one line per stage, nested figures kept short."""

from __future__ import annotations

from aerie.manifest import StageResult
from aerie.pipeline import PipelineReport, figure_text
from aerie.presets import get_preset

PHASES = {
    "wall_s": 5.5,
    "client": {"http_wait": {"s": 5.36, "share": 0.973}, "other": {"s": 0.09, "share": 0.016}},
    "server": {"idle": {"s": 0.1, "share": 0.019}, "forward": {"s": 5.3, "share": 0.963}},
}


def test_a_nested_figure_shows_its_largest_shares_and_the_line_stays_short() -> None:
    result = StageResult(
        stage="extract", key="k", prefix="r/extract/k", manifest_uri="/s/r/extract/k/manifest.json",
        manifest_sha256="0" * 64, cache_hit=False, seconds=14.3,
        figures={"tokens": 26000, "tokens_per_s": 182.23, "phases": PHASES, "canary_passed": True},
    )  # fmt: skip
    report = PipelineReport(config=get_preset("smollm2-local"), results=[result], seconds=14.3)
    line = report.table().splitlines()[2]
    assert "tokens=26,000, tokens_per_s=182.2, phases=(client.http_wait 0.97, server.forward 0.96, " in line
    assert "'s':" not in line and line.endswith("canary_passed=True")
    assert figure_text({"a": 1, "b": 2}) == "(2 entries; see the manifest)"


def test_a_cache_hit_shows_this_runs_time_beside_the_original(tmp_path) -> None:
    from aerie.manifest import StageDir
    from aerie.store import LocalStore

    store = LocalStore(tmp_path)
    ran = StageDir(store, "r", "merge", "k")
    ran.started -= 73.0  # as if the stage had worked for 73 s
    first = ran.finish({"figures": {"records": 3}})
    hit = StageDir(store, "r", "merge", "k").cached_result()
    assert hit is not None and hit.cache_hit and hit.original_seconds == first.seconds >= 73.0
    assert hit.seconds < first.seconds
    report = PipelineReport(config=get_preset("smollm2-local"), results=[hit], seconds=hit.seconds)
    assert f"the stage took {first.seconds:.1f} s when it ran" in report.table()
