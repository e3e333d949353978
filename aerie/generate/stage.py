"""The generation stage in the pipeline (`aerie.stage` contract): every dataset of `generate.datasets`,
one result each, with the embedded endpoint (`aerie.generate.server`: the configured server serving the
target) launched only when some dataset still has to be generated. The work itself is
`aerie.generate.work`, imported when it runs (httpx, Polars)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from aerie.errors import ConfigError, EndpointError, StoreError
from aerie.generate.server import generation_endpoint
from aerie.manifest import StageDir, StageResult, stage_key
from aerie.stage import Stage, StageJob, StagePart, run_parts
from aerie.store import ArtifactStore
from aerie.targets import TargetInfo

if TYPE_CHECKING:
    from aerie.config import PipelineConfig
    from aerie.generate.config import DatasetSpec, GenerateConfig


def generate_config(cfg: PipelineConfig) -> GenerateConfig:
    """`cfg.generate` as the stage runs it: a dataset's `max_context_tokens` left at None takes the
    corpus's max_length (what the corpus keeps of a conversation is all that is worth generating)."""
    datasets = [
        spec
        if spec.max_context_tokens is not None
        else spec.model_copy(update={"max_context_tokens": cfg.corpus.max_length})
        for spec in cfg.generate.datasets
    ]
    update: dict[str, object] = {"datasets": datasets}
    if cfg.corpus.chat_template and not cfg.generate.endpoint.base_url:
        # The launched server renders with the corpus's template: another template, other answers.
        import hashlib

        from aerie.reasoning import read_template

        update["chat_template_sha256"] = hashlib.sha256(
            read_template(cfg.corpus.chat_template).encode()
        ).hexdigest()
    return cfg.generate.model_copy(update=update)


def generation_pending(cfg: PipelineConfig, store: ArtifactStore) -> bool:
    """True when some dataset still needs the target (so an embedded endpoint must be launched, and a
    remote one needs its key). Asked before the run's config is resolved too (`aerie.pipeline.check_secrets`
    runs before the target is), so it completes generation's section itself."""
    from aerie.generate.work import key_of, stage_name

    gen = generate_config(cfg)
    return any(
        spec.regenerate and StageDir(store, cfg.run, stage_name(spec), key_of(gen, spec)).manifest() is None
        for spec in gen.datasets
    )


class Endpoint(BaseModel):
    """What generation's parts share: the endpoint's URL (None: the configured one) and the seconds the
    launched server took to start (counted in each dataset's time)."""

    model_config = ConfigDict(frozen=True)

    url: str | None = None
    start_s: float = 0.0


class GenerateStage(Stage):
    """A part per dataset (`generate-<dataset>`, each its own StageDir and key), up to
    `generate.max_parallel_datasets` at a time, around one endpoint."""

    name = "generate"
    part_error = EndpointError

    def resolve(self, cfg: PipelineConfig, target: TargetInfo) -> PipelineConfig:
        return cfg.model_copy(update={"generate": generate_config(cfg)})

    def key(self, job: StageJob) -> str:
        """The datasets' own keys together (each dataset's result lives under its own key)."""
        return stage_key(self.name, [part.key for part in self.parts(job)])

    def parts(self, job: StageJob) -> list[StagePart]:
        """One part per dataset, in config order. A key hashes the dataset's source file: each is
        worked out once per run (`ctx.keys`)."""
        from aerie.generate.work import key_of, stage_name

        gen, keys = job.cfg.generate, job.ctx.keys
        names = [spec.name for spec in gen.datasets]
        if len(set(names)) != len(names):
            raise ConfigError(f"generate.datasets: dataset names must be unique, got {names}")
        parts = []
        for i, spec in enumerate(gen.datasets):
            memo = (stage_name(spec), gen.model_dump_json(), spec.model_dump_json())
            if (key := keys.get(memo)) is None:
                key = keys[memo] = key_of(gen, spec)
            name = stage_name(spec)
            parts.append(StagePart(index=i, name=name, label=f"dataset {spec.name}", dir_stage=name, key=key))
        return parts

    def cached(self, job: StageJob) -> list[StageResult] | None:
        ctx = job.ctx
        found = [part.stage_dir(ctx.store, ctx.run).cached_result() for part in self.parts(job)]
        return None if any(r is None for r in found) else [r for r in found if r is not None]

    def needs(self, job: StageJob) -> bool:
        """Work for the target: a dataset taken as it is (`regenerate: false`) costs no endpoint."""
        return bool(self._to_ask(job, self.parts(job)))

    def _to_ask(self, job: StageJob, parts: list[StagePart]) -> list[DatasetSpec]:
        """The datasets not generated yet that ask the target."""
        return [
            spec
            for spec, part in zip(job.cfg.generate.datasets, parts, strict=True)
            if spec.regenerate and not self.part_done(job, part)
        ]

    @contextlib.contextmanager
    def around_parts(self, job: StageJob, parts: list[StagePart]) -> Iterator[Endpoint]:
        """The endpoint, launched (the embedded default) only when some dataset still asks the target,
        and checked once for every dataset, in seconds: a dead endpoint or a rejected key stops here."""
        from aerie.generate.work import check_endpoint_for

        cfg = job.cfg
        asking = self._to_ask(job, parts)
        if not asking:
            yield Endpoint()
            return
        began = time.monotonic()
        with generation_endpoint(cfg, job.ctx.target) as url:
            launched = cfg.generate.endpoint.base_url is None
            shared = Endpoint(url=url, start_s=time.monotonic() - began if launched else 0.0)
            check_endpoint_for(cfg.generate, asking[0], url)
            try:
                yield shared
            except BaseException:  # Ctrl-C before the parts' wait took it: stop them, not wait for them
                from aerie.generate.work import cancel_running

                cancel_running()
                raise

    def part_done(self, job: StageJob, part: StagePart) -> bool:
        return part.stage_dir(job.ctx.store, job.ctx.run).manifest() is not None

    def run_part(self, job: StageJob, part: StagePart, shared: Any) -> StageResult:
        from aerie.generate.work import run

        cfg, ctx = job.cfg, job.ctx
        endpoint = shared if isinstance(shared, Endpoint) else Endpoint()
        return run(
            cfg.generate,
            cfg.generate.datasets[part.index],
            part.stage_dir(ctx.store, ctx.run),
            base_url=endpoint.url,
            progress=ctx.progress(part.name),
            server_start_s=endpoint.start_s,
            preflight=False,
        )

    def assemble(
        self, job: StageJob, parts: list[StagePart], outcomes: dict[int, BaseModel]
    ) -> list[StageResult]:
        """Each dataset's result: as its part returned it this run, else the one an earlier run made."""
        ctx = job.ctx
        results = []
        for part in parts:
            result = outcomes.get(part.index)
            if not isinstance(result, StageResult):
                result = part.stage_dir(ctx.store, ctx.run).cached_result()
                if result is None:  # done when the parts started, gone since
                    raise StoreError(f"generation: {part.label} has no manifest any more; run it again")
                ctx.progress(part.name)(1.0, "cached")
            results.append(result)
        return results

    def max_parallel_parts(self, job: StageJob) -> int:
        return job.cfg.generate.max_parallel_datasets

    def wait_parts(self, futures: Iterable[Future[Any]]) -> None:
        """Ctrl-C: the datasets' requests are cancelled and one line says what each kept."""
        from aerie.generate.interrupt import wait_or_interrupt
        from aerie.generate.work import cancel_running

        wait_or_interrupt(futures, cancel_running)

    def run(self, job: StageJob) -> list[StageResult]:
        return run_parts(job)


GENERATE = GenerateStage()
