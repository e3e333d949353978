"""The one fan-out of a stage of parts (`aerie.stage.run_parts`), on a toy stage whose parts write into
a real local store: parts finished by an earlier run are skipped, what the parts share is made once
around the parts still to do, a failing part does not stop the others, one failure is raised as it is,
several as the stage's `part_error` naming each, and a re-run runs only what is left."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from aerie.config import PipelineConfig
from aerie.errors import DataError, TrainingError
from aerie.manifest import StageResult
from aerie.stage import Stage, StageContext, StageJob, StagePart, run_parts
from aerie.store import LocalStore
from aerie.targets import TargetInfo


class ToyRecord(BaseModel):
    index: int
    shared: str


class ToyStage(Stage):
    """Three parts, each writing `part-<i>` into the stage's StageDir; `fail` names the parts that raise."""

    name = "toy"
    part_error = TrainingError

    def __init__(self, fail: set[int]) -> None:
        self.fail = fail
        self.entered: list[list[int]] = []  # the parts still to do, each time `around_parts` was entered
        self.ran: list[int] = []
        self.lock = threading.Lock()

    def key(self, job: StageJob) -> str:
        return "k"

    def run(self, job: StageJob) -> list[StageResult]:
        return run_parts(job)

    def parts(self, job: StageJob) -> list[StagePart]:
        return [
            StagePart(index=i, name=f"toy-{i}", label=f"toy part {i}", dir_stage="toy", key="k")
            for i in range(3)
        ]

    @contextlib.contextmanager
    def around_parts(self, job: StageJob, parts: list[StagePart]) -> Iterator[str]:
        self.entered.append([p.index for p in parts if not self.part_done(job, p)])
        yield f"shared-{len(self.entered)}"

    def part_done(self, job: StageJob, part: StagePart) -> bool:
        ctx = job.ctx
        return ctx.store.exists(part.stage_dir(ctx.store, ctx.run).path(f"part-{part.index}"))

    def run_part(self, job: StageJob, part: StagePart, shared: Any) -> BaseModel:
        ctx = job.ctx
        with self.lock:
            self.ran.append(part.index)
        if part.index in self.fail:
            raise DataError(f"part {part.index} has bad data")
        ctx.store.put_bytes(part.stage_dir(ctx.store, ctx.run).path(f"part-{part.index}"), shared.encode())
        return ToyRecord(index=part.index, shared=shared)

    def assemble(
        self, job: StageJob, parts: list[StagePart], outcomes: dict[int, BaseModel]
    ) -> list[StageResult]:
        ctx = job.ctx
        stage_dir = parts[0].stage_dir(ctx.store, ctx.run)
        written = [ctx.store.get_bytes(stage_dir.path(f"part-{p.index}")).decode() for p in parts]
        return [stage_dir.finish({"figures": {"written": written, "run_now": sorted(outcomes)}})]

    def max_parallel_parts(self, job: StageJob) -> int:
        return 2


@pytest.fixture
def ctx(tmp_path: Path) -> StageContext:
    target = TargetInfo.model_construct(name="(none: the toy stage reads no target)")
    return StageContext(store=LocalStore(tmp_path / "store"), run="r", target=target)


def test_a_failing_part_spares_the_others_and_a_rerun_runs_only_it(ctx: StageContext) -> None:
    cfg = PipelineConfig(run="r")
    stage = ToyStage(fail={1})
    job = stage.job(cfg, ctx)
    with pytest.raises(DataError, match="part 1 has bad data"):  # one failure: raised as it is
        stage.run(job)
    assert sorted(stage.ran) == [0, 1, 2]  # the others ran to their end
    assert [stage.part_done(job, p) for p in stage.parts(job)] == [True, False, True]

    stage.fail = set()
    (result,) = stage.run(job)
    assert stage.entered == [[0, 1, 2], [1]]  # around the parts still to do, each time
    assert sorted(stage.ran) == [0, 1, 1, 2]  # only the failed part ran again
    assert result.figures["written"] == ["shared-1", "shared-2", "shared-1"]  # what each run shared
    assert result.figures["run_now"] == [1]


def test_several_failures_are_the_stages_error_naming_each(ctx: StageContext) -> None:
    stage = ToyStage(fail={0, 2})
    with pytest.raises(
        TrainingError, match=r"toy: 2 of 3 parts failed: toy part 0: part 0 has bad data; "
    ) as err:
        stage.run(stage.job(PipelineConfig(run="r"), ctx))
    assert "toy part 2: part 2 has bad data" in str(err.value)
    assert isinstance(err.value.__cause__, DataError)


def test_a_stage_whose_parts_are_done_runs_none(ctx: StageContext) -> None:
    cfg = PipelineConfig(run="r")
    first = ToyStage(fail=set())
    first.run(first.job(cfg, ctx))
    again = ToyStage(fail=set())
    (result,) = again.run(again.job(cfg, ctx))
    assert again.ran == [] and again.entered == [[]]
    assert result.figures["run_now"] == []
