"""The extraction stage in the pipeline (`aerie.stage` contract): the corpus through the target's
server into hidden-state shards. The work itself is `aerie.extract.work` (one host) or
`aerie.extract.slices` (a slice per host), imported when it runs (torch)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pydantic import BaseModel

from aerie.errors import ExtractionError
from aerie.manifest import StageResult
from aerie.stage import Stage, StageJob, StagePart, WorkContext, run_parts

if TYPE_CHECKING:
    from aerie.config import PipelineConfig
    from aerie.extract.config import ExtractConfig
    from aerie.targets import TargetInfo


def extract_config(cfg: PipelineConfig, target: TargetInfo) -> ExtractConfig:
    """`cfg.extract` with the layers to capture filled in from `train.drafter`'s family (unless set):
    the shards hold what the drafter reads, and every later reader takes them from here. The key is
    unchanged where they are EAGLE-3's (`aerie.extract.plan.extract_key` names other layers only)."""
    ex = cfg.extract
    if ex.capture_layers is not None:
        return ex
    return ex.model_copy(update={"capture_layers": cfg.train.capture_layers(target.geometry.num_layers)})


class ExtractStage(Stage):
    """One piece of work on one host, or with `extract.num_slices` > 1 a part per slice (each with its
    own servers, on this host one after the other or each on a host of `extract.slice_deployment`)
    assembled into one stage from the slices' records (`aerie.extract.slices`)."""

    name = "extract"
    part_error = ExtractionError

    def resolve(self, cfg: PipelineConfig, target: TargetInfo) -> PipelineConfig:
        return cfg.model_copy(update={"extract": extract_config(cfg, target)})

    def enabled(self, cfg: PipelineConfig) -> bool:
        """An online training (`train.source: online`) runs its own servers: no shards to make."""
        return cfg.train.source != "online"

    def key(self, job: StageJob) -> str:
        from aerie.extract.plan import extract_key

        return extract_key(job.cfg.extract, job.cfg.server, job.ctx.target, job.upstream.corpus)

    def needs(self, job: StageJob) -> bool:
        """No manifest yet, or (with `ctx.rebuild_missing`) a manifest whose shards are not all in the
        store: a manifest can travel without its shards (hidden states are cheaper to re-extract than to move)."""
        from aerie.shards.keys import missing_shards

        cached = self.cached(job)
        if cached is None:
            return True
        return job.ctx.rebuild_missing and bool(missing_shards(job.ctx.store, cached[0]))

    def run(self, job: StageJob) -> list[StageResult]:
        from aerie.extract.work import run

        cfg = job.cfg
        if cfg.extract.num_slices > 1:
            return run_parts(job)
        return [
            run(
                cfg.extract,
                job.work(),
                corpus=job.upstream.corpus,
                server=cfg.server,
                rebuild_missing=job.ctx.rebuild_missing,
            )
        ]

    def parts(self, job: StageJob) -> list[StagePart]:
        n, key = job.cfg.extract.num_slices, job.key()
        if n == 1:
            return []
        return [
            StagePart(
                index=k, name=f"slice-{k}-of-{n}", label=f"slice {k} of {n}", dir_stage=self.name, key=key
            )
            for k in range(n)
        ]

    @contextlib.contextmanager
    def around_parts(self, job: StageJob, parts: list[StagePart]) -> Iterator[None]:
        """The checks before any slice (`aerie.extract.work.prepare`); each slice host runs its own disk
        preflight, the parent none."""
        from aerie.extract.work import prepare

        cfg = job.cfg
        prepare(cfg.extract, job.stage_dir(), server=cfg.server, rebuild_missing=job.ctx.rebuild_missing)
        yield None

    def part_done(self, job: StageJob, part: StagePart) -> bool:
        from aerie.extract.slices import read_record

        stage_dir = part.stage_dir(job.ctx.store, job.ctx.run)
        return read_record(stage_dir, part.index, job.cfg.extract.num_slices) is not None

    def run_part(self, job: StageJob, part: StagePart, shared: object) -> BaseModel:
        """One slice on this host, with the target as this host has it."""
        from aerie.extract.slices import local_target, run_slice

        ctx, cfg = job.ctx, job.cfg
        work = WorkContext(
            stage_dir=part.stage_dir(ctx.store, ctx.run),
            target=local_target(ctx.target),
            progress=ctx.progress(part.name),
        )
        return run_slice(cfg.extract, part.index, work, corpus=job.upstream.corpus, server=cfg.server)

    def assemble(
        self, job: StageJob, parts: list[StagePart], outcomes: dict[int, BaseModel]
    ) -> list[StageResult]:
        """The stage manifest from the slices' records (a cache hit once written)."""
        from aerie.extract.slices import assemble

        cfg = job.cfg
        return [assemble(cfg.extract, job.work(), corpus=job.upstream.corpus, server=cfg.server)]


EXTRACT = ExtractStage()
