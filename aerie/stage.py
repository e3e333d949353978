"""The typed contract every pipeline stage keeps, and the context it runs in.

A stage is one object (each stage package exports one: `aerie.generate.stage.GENERATE`, ...) with a
`name`. The composer makes one `StageJob` per stage of a run (`Stage.job`): the whole resolved
`PipelineConfig` (`cfg`), a `StageContext` (`ctx`: where and for what it runs) and its `Upstream`
(the results of the stages before it in this run). Every member of a run takes that one job:

    resolve(cfg, target) -> PipelineConfig     its own section completed from the others (before any job)
    key(job) -> str                            what decides its output: `<run>/<name>/<key>/`
    needs(job) -> bool                         whether it has work to do (else `run` is a cache hit)
    run(job) -> list[StageResult]              do it, or return what an earlier run made
    predict(job) -> Any                        what it expects, logged before it runs (deploy's speed-up)
    with_prediction(prediction, results)       its results with that prediction beside what it measured

The job works out the stage's key once (`StageJob.key`, remembered in the `StageContext` for the rest
of the run, so `needs`, `cached` and `run` hash it once between them) and its `StageDir`
(`StageJob.stage_dir`); `run` hands the work function of its package (`aerie.corpus.work.run`, ...) a
`WorkContext` (`StageJob.work`): that StageDir (`stage_dir`, whose store and run it writes to), the
target and the progress callback, with the inputs the work reads (the corpus, the server config, ...)
beside it. Below a stage's `run` nothing derives a key or places an output: a work function writes
where its `stage_dir` says.

A stage of parts (generation: a dataset each; extraction with `num_slices` > 1: a slice each) also
defines how its work comes apart and together again, so one fan-out runs them all, here in threads
(`run_parts`) or under Prefect as a subflow per part or a run of a deployment per part (`flows.stage`):

    parts(job) -> list[StagePart]              every part, in order ([] for a stage of one piece)
    around_parts(job, parts)                   what the parts share (generation's endpoint)
    part_done(job, part) -> bool               finished by an earlier run (skipped)
    run_part(job, part, shared)                one part; returns its record
    assemble(job, parts, outcomes)             the stage's results, once every part is done

`resolve` runs once per run, before any stage (`aerie.pipeline.resolve`): a setting one section
derives from another (the layers extraction captures from the drafter family, the evaluation's prompt
format from the corpus) is filled into the stage's own section there, so `key` and `run` read only
their own section of the resolved config. `run` returns a list because generation makes one result
per dataset; every other stage makes one.
The composers call nothing else of a stage: `aerie.pipeline.compose` (the only ordered list of stages)
runs them in this process or, through `flows.pipeline`, as Prefect subflows.
"""

from __future__ import annotations

import contextlib
import contextvars
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from aerie.errors import AerieError, ConfigError
from aerie.manifest import StageDir, StageResult
from aerie.progress import ProgressFactory, ProgressFn, no_progress
from aerie.store import ArtifactStore
from aerie.targets import TargetInfo

if TYPE_CHECKING:  # the config imports every stage's config; a stage needs only its type
    from aerie.config import PipelineConfig


def _no_progress(name: str) -> ProgressFn:
    return no_progress


@dataclass(frozen=True)
class WorkContext:
    """What a stage's work function (`aerie.corpus.work.run`, ...) is handed: where its output goes,
    made once by its `Stage`, the target and where progress goes."""

    stage_dir: StageDir
    target: TargetInfo
    progress: ProgressFn = no_progress

    @property
    def store(self) -> ArtifactStore:
        return self.stage_dir.store

    @property
    def run(self) -> str:
        return self.stage_dir.run


@dataclass(frozen=True)
class StageContext:
    """Where a stage runs and for what: the same for every stage of a run, but for `rebuild_missing`,
    which the composer decides per stage."""

    store: ArtifactStore
    run: str
    target: TargetInfo
    progress: ProgressFactory = field(default=_no_progress)
    # Make a finished output whole again where part of it is gone (extraction's shards, which never
    # travel with a run's manifests): the composer asks for it when the next stage reads that output.
    rebuild_missing: bool = False
    # Each stage's key as worked out this run, by what decides it (`StageJob.key`): shared by the
    # copies `dataclasses.replace` makes, so the composer's look-ahead (`aerie.pipeline.rebuild_missing`)
    # and the stage's own run hash it once.
    keys: dict[tuple[str, ...], str] = field(default_factory=dict, compare=False, repr=False)

    def work(self, stage_dir: StageDir, name: str | None = None) -> WorkContext:
        """What the work writing to `stage_dir` is handed, its progress reported under `name` (the
        stage's)."""
        return WorkContext(
            stage_dir=stage_dir, target=self.target, progress=self.progress(name or stage_dir.stage)
        )


class Upstream(BaseModel):
    """The results of the stages run before, by stage name (serializable: Prefect passes it between
    flows)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    results: dict[str, list[StageResult]] = Field(default_factory=dict)

    def plus(self, stage: str, results: list[StageResult]) -> Upstream:
        return Upstream(results={**self.results, stage: list(results)})

    def all_of(self, stage: str) -> list[StageResult]:
        if stage not in self.results:
            raise ConfigError(
                f"no result of stage {stage!r} upstream (have: {', '.join(self.results) or 'none'}): "
                "a stage runs after the stages it reads"
            )
        return self.results[stage]

    def one(self, stage: str) -> StageResult:
        (result,) = self.all_of(stage)
        return result

    @property
    def generated(self) -> list[StageResult]:
        return self.all_of("generate")

    @property
    def corpus(self) -> StageResult:
        return self.one("merge")

    @property
    def shards(self) -> StageResult:
        return self.one("extract")

    @property
    def drafter(self) -> StageResult:
        return self.one("train")

    @property
    def evaluation(self) -> StageResult | None:
        """None where the evaluate stage is disabled (`evaluate.enabled: false`)."""
        return self.one("evaluate") if "evaluate" in self.results else None


class StagePart(BaseModel):
    """One piece of a stage of parts: a dataset to generate, a slice of the corpus to extract. Its output
    (or its record) lives in the StageDir `<run>/<dir_stage>/<key>/`, worked out with the parts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int  # its place among the stage's parts
    name: str  # its progress artifact, its subflow run (`generate-alpha`, `slice-0-of-2`)
    label: str  # what errors and logs call it (`dataset alpha`, `slice 0 of 2`)
    dir_stage: str
    key: str

    def stage_dir(self, store: ArtifactStore, run: str) -> StageDir:
        return StageDir(store, run, self.dir_stage, self.key)


# What runs the parts still to do: each part's record, or the exception that stopped it, in order.
PartsRunner = Callable[[list[StagePart], Any], list["BaseModel | BaseException"]]


@dataclass(frozen=True)
class StageJob:
    """One stage in one run, made once by the composer and handed to every member of the stage's
    contract: the run's resolved config, where and for what it runs, and what the stages before it made.
    The stage's key is hashed once per run and what decides it (remembered in `ctx.keys`)."""

    stage: Stage
    cfg: PipelineConfig
    ctx: StageContext
    upstream: Upstream = field(default_factory=Upstream)

    def key(self) -> str:
        """The stage's key (`Stage.key`), worked out once for this config and these upstream outputs."""
        memo = self._memo()
        if (key := self.ctx.keys.get(memo)) is None:
            key = self.ctx.keys[memo] = self.stage.key(self)
        return key

    def remember_key(self, key: str) -> None:
        """Take `key` as the stage's key here (worked out by a caller that passed it on: a Prefect
        subflow to its task)."""
        self.ctx.keys[self._memo()] = key

    def _memo(self) -> tuple[str, ...]:
        # An upstream output is named by its place and manifest digest: the same output read from the
        # store again (the look-ahead's) and as its stage returned it (with this run's timings) agree.
        outputs = [
            f"{r.prefix}@{r.manifest_sha256}" for results in self.upstream.results.values() for r in results
        ]
        return (self.stage.name, self.cfg.model_dump_json(), *outputs)

    def stage_dir(self) -> StageDir:
        """Where the stage's output lives in the store: new each time, its clock starting now."""
        return StageDir(self.ctx.store, self.ctx.run, self.stage.name, self.key())

    def work(self) -> WorkContext:
        """What the stage's work function is handed: a new `stage_dir`, the target, the progress."""
        return self.ctx.work(self.stage_dir(), self.stage.name)


class Stage(ABC):
    """One stage of the pipeline. Subclasses set `name` and define `key` and `run`; `needs` is "no
    manifest yet" unless a stage knows better."""

    name: ClassVar[str]

    @abstractmethod
    def key(self, job: StageJob) -> str:
        """What decides the output (config, upstream manifest digests, aerie's version), hashed."""

    @abstractmethod
    def run(self, job: StageJob) -> list[StageResult]:
        """Do the stage's work, or return the cached result; resumes what an interrupted run left."""

    def enabled(self, cfg: PipelineConfig) -> bool:
        """False leaves the stage out of the run (no result at all)."""
        return True

    def resolve(self, cfg: PipelineConfig, target: TargetInfo) -> PipelineConfig:
        """`cfg` with this stage's section completed from the other sections (idempotent); as it is by
        default."""
        return cfg

    def job(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream | None = None) -> StageJob:
        """This stage's job in a run."""
        return StageJob(self, cfg, ctx, Upstream() if upstream is None else upstream)

    def cached(self, job: StageJob) -> list[StageResult] | None:
        """What an earlier run finished (its manifest), or None."""
        result = job.stage_dir().cached_result()
        return None if result is None else [result]

    def needs(self, job: StageJob) -> bool:
        return self.cached(job) is None

    def predict(self, job: StageJob) -> Any:
        """What the composer logs before the stage runs, to set beside what it measures
        (`with_prediction`); None by default."""
        return None

    def with_prediction(self, prediction: Any, results: list[StageResult]) -> list[StageResult]:
        """The stage's results with `predict`'s prediction among their figures; as they are by default."""
        return results

    # -- a stage of parts (see the module's docstring); a stage of one piece keeps these defaults --

    # What a failure of several parts, or of a part run elsewhere, is raised as.
    part_error: ClassVar[type[AerieError]] = AerieError

    def parts(self, job: StageJob) -> list[StagePart]:
        """Every part of this stage's work in order; [] for a stage of one piece (`run` does it all)."""
        return []

    def around_parts(self, job: StageJob, parts: list[StagePart]) -> AbstractContextManager[Any]:
        """Entered around the parts still to do, in the process that runs them or starts their runs:
        what it yields is handed to every part (`run_part`'s `shared`)."""
        return contextlib.nullcontext()

    def part_done(self, job: StageJob, part: StagePart) -> bool:
        raise NotImplementedError(f"stage {self.name} has no parts")

    def run_part(self, job: StageJob, part: StagePart, shared: Any) -> BaseModel:
        """Do one part, or return its record where an earlier run finished it."""
        raise NotImplementedError(f"stage {self.name} has no parts")

    def assemble(
        self, job: StageJob, parts: list[StagePart], outcomes: dict[int, BaseModel]
    ) -> list[StageResult]:
        """The stage's results from its finished parts (`outcomes`: the records of the parts run now,
        by index, where the runner has them)."""
        raise NotImplementedError(f"stage {self.name} has no parts")

    def max_parallel_parts(self, job: StageJob) -> int:
        """How many parts run at once in one process."""
        return 1

    def wait_parts(self, futures: Iterable[Future[Any]]) -> None:
        """Wait for the parts running in threads (generation stops them on Ctrl-C)."""
        wait(list(futures))


def run_parts(
    job: StageJob, *, parts: list[StagePart] | None = None, runner: PartsRunner | None = None
) -> list[StageResult]:
    """A stage of parts, the one fan-out: around the parts still to do (`around_parts`), run them
    (`runner`; by default `stage.run_part` in threads of this process, `in_threads`), then `assemble`. Parts
    finished by an earlier run are skipped; a failing part does not stop the others, and the first
    failure is raised once all have ended (several: the stage's `part_error` naming each), with what
    the others finished kept."""
    stage = job.stage
    parts = stage.parts(job) if parts is None else parts
    with stage.around_parts(job, parts) as shared:
        todo = [part for part in parts if not stage.part_done(job, part)]
        run = runner or in_threads(job)
        outcomes = dict(zip((p.index for p in todo), run(todo, shared), strict=True)) if todo else {}
    failed = [(p, o) for p in todo if isinstance(o := outcomes[p.index], BaseException)]
    if len(failed) == 1:
        raise failed[0][1]
    if failed:
        # An error that names its part already (a part run elsewhere: `flows.fanout`) is taken as it is.
        lines = "; ".join(str(o) if str(o).startswith(p.label) else f"{p.label}: {o}" for p, o in failed)
        raise stage.part_error(
            f"{stage.name}: {len(failed)} of {len(parts)} parts failed: {lines}; what the others finished "
            "is kept, a re-run runs only what is left"
        ) from failed[0][1]
    done = {i: o for i, o in outcomes.items() if isinstance(o, BaseModel)}
    return stage.assemble(job, parts, done)


def in_threads(job: StageJob, one: Callable[[StagePart, Any], BaseModel] | None = None) -> PartsRunner:
    """Run parts in threads of this process, `stage.max_parallel_parts` at a time: each `one(part,
    shared)` (by default `stage.run_part`) in a copy of the caller's context (under Prefect: so that a
    part's subflow is linked under the stage's)."""

    stage = job.stage

    def here(part: StagePart, shared: Any) -> BaseModel:
        return stage.run_part(job, part, shared)

    def runner(todo: list[StagePart], shared: Any) -> list[BaseModel | BaseException]:
        pool = ThreadPoolExecutor(max_workers=stage.max_parallel_parts(job), thread_name_prefix=stage.name)
        try:
            call = one or here
            futures = [pool.submit(contextvars.copy_context().run, call, part, shared) for part in todo]
            stage.wait_parts(futures)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        outcomes: list[BaseModel | BaseException] = []
        for future in futures:
            try:
                outcomes.append(future.result())
            except Exception as exc:  # collected: the other parts kept running
                outcomes.append(exc)
        return outcomes

    return runner
