"""The typed contract every pipeline stage keeps, and the context it runs in.

A stage is one object (each stage package exports one: `aerie.generate.stage.GENERATE`, ...) with a
`name` and three methods over the whole `PipelineConfig`, a `StageContext` (where and for what it runs)
and its `Upstream` (the results of the stages before it in this run):

    resolve(cfg, target) -> PipelineConfig            its own section with what it derives from others
    key(cfg, ctx, upstream) -> str                    what decides its output: `<run>/<name>/<key>/`
    needs(cfg, ctx, upstream) -> bool                 whether it has work to do (else `run` is a cache hit)
    run(cfg, ctx, upstream) -> list[StageResult]      do it, or return what an earlier run made

`run` works out its `StageDir` once (`Stage.stage_dir`: the key, remembered in the `StageContext` for
the rest of the run, so `needs`, `cached` and `run` hash it once between them) and hands the work
function of its package (`aerie.corpus.work.run`, ...) a `WorkContext`: that StageDir (`out`, whose
store and run it writes to), the target and the progress callback, with the inputs the work reads
(the corpus, the server config, ...) beside it. Below a stage's `run` nothing derives a key or places
an output: a work function writes where its `out` says.

`resolve` runs once per run, before any stage (`aerie.pipeline.resolve`): a setting one section
derives from another (the layers extraction captures from the drafter family, the evaluation's prompt
format from the corpus) is filled into the stage's own section there, so `key` and `run` read only
their own section of the resolved config. `run` returns a list because generation makes one result
per dataset; every other stage makes one.
The composers call nothing else of a stage: `aerie.pipeline.compose` (the only ordered list of stages)
runs them in this process or, through `flows.pipeline`, as Prefect subflows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from aerie.errors import ConfigError
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

    out: StageDir
    target: TargetInfo
    progress: ProgressFn = no_progress

    @property
    def store(self) -> ArtifactStore:
        return self.out.store

    @property
    def run(self) -> str:
        return self.out.run


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
    # Each stage's key as worked out this run, by what decides it (`Stage.stage_dir`): shared by the
    # copies `dataclasses.replace` makes, so the composer's look-ahead (`aerie.pipeline.rebuild_missing`)
    # and the stage's own run hash it once.
    keys: dict[tuple[str, ...], str] = field(default_factory=dict, compare=False, repr=False)

    def work(self, out: StageDir, name: str | None = None) -> WorkContext:
        """What the work writing to `out` is handed, its progress reported under `name` (the stage's)."""
        return WorkContext(out=out, target=self.target, progress=self.progress(name or out.stage))


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


class Stage(ABC):
    """One stage of the pipeline. Subclasses set `name` and define `key` and `run`; `needs` is "no
    manifest yet" unless a stage knows better."""

    name: ClassVar[str]

    @abstractmethod
    def key(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> str:
        """What decides the output (config, upstream manifest digests, aerie's version), hashed."""

    @abstractmethod
    def run(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> list[StageResult]:
        """Do the stage's work, or return the cached result; resumes what an interrupted run left."""

    def enabled(self, cfg: PipelineConfig) -> bool:
        """False leaves the stage out of the run (no result at all)."""
        return True

    def resolve(self, cfg: PipelineConfig, target: TargetInfo) -> PipelineConfig:
        """`cfg` with this stage's section completed from the other sections (idempotent); as it is by
        default."""
        return cfg

    def stage_dir(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> StageDir:
        """Where the output lives in the store. The key is hashed once per run and what decides it
        (remembered in `ctx.keys`); the StageDir is new each time, its clock starting now."""
        return StageDir(ctx.store, ctx.run, self.name, self.remembered_key(cfg, ctx, upstream))

    def remembered_key(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> str:
        """`key`, worked out once for this config and these upstream outputs in this run's context."""
        memo = self._memo(cfg, upstream)
        if (key := ctx.keys.get(memo)) is None:
            key = ctx.keys[memo] = self.key(cfg, ctx, upstream)
        return key

    def remember_key(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream, key: str) -> None:
        """Take `key` as this stage's key here (worked out by a caller that passed it on: a Prefect
        subflow to its task)."""
        ctx.keys[self._memo(cfg, upstream)] = key

    def _memo(self, cfg: PipelineConfig, upstream: Upstream) -> tuple[str, ...]:
        # An upstream output is named by its place and manifest digest: the same output read from the
        # store again (the look-ahead's) and as its stage returned it (with this run's timings) agree.
        outputs = [
            f"{r.prefix}@{r.manifest_sha256}" for results in upstream.results.values() for r in results
        ]
        return (self.name, cfg.model_dump_json(), *outputs)

    def cached(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> list[StageResult] | None:
        """What an earlier run finished (its manifest), or None."""
        result = self.stage_dir(cfg, ctx, upstream).cached_result()
        return None if result is None else [result]

    def needs(self, cfg: PipelineConfig, ctx: StageContext, upstream: Upstream) -> bool:
        return self.cached(cfg, ctx, upstream) is None
