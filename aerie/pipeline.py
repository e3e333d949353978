"""The pipeline: the only ordered list of stages, and the one composer that runs them.

    generate-<dataset> (one per dataset) ─┐
                                          ├─> merge ─> extract ─> train ─> evaluate ─> deploy
    (the target, resolved once) ──────────┘

Each stage keeps the contract of `aerie.stage`; `compose` runs them in order, each fed the results
before it. `run_pipeline` runs them in this process (`aerie run PRESET --no-prefect [--until STAGE]`,
what a GPU host without a Prefect server runs); `flows.pipeline` passes the same list through one
Prefect subflow per stage. Every stage caches on its manifest, so a re-run resumes where the last one
stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from aerie.config import PipelineConfig
from aerie.corpus.stage import MERGE
from aerie.deploy.stage import DEPLOY
from aerie.errors import ConfigError
from aerie.evaluate.stage import EVALUATE
from aerie.extract.stage import EXTRACT
from aerie.generate.stage import GENERATE, generation_pending
from aerie.manifest import StageResult
from aerie.plan import online as online_plan
from aerie.plan import track
from aerie.plan.plan import Plan
from aerie.progress import ProgressFactory, terminal_progress
from aerie.reasoning import reasoning_line
from aerie.stage import Stage, StageContext, StageJob, Upstream
from aerie.store import ArtifactStore, open_store
from aerie.targets import TargetInfo, resolve_target
from aerie.train.stage import TRAIN

log = logging.getLogger(__name__)

STAGES: tuple[Stage, ...] = (GENERATE, MERGE, EXTRACT, TRAIN, EVALUATE, DEPLOY)
STAGE_NAMES: tuple[str, ...] = tuple(stage.name for stage in STAGES)


@dataclass
class PipelineReport:
    """What a run produced: one StageResult per stage run, in order."""

    config: PipelineConfig
    results: list[StageResult] = field(default_factory=list)
    seconds: float = 0.0
    gpu_seconds: float | None = None  # over every call (`aerie.plan.track.gpu_seconds`)

    def table(self) -> str:
        """The one summary `make run` ends with: stage, time, cache hit, key figures, artifact path."""
        lines = [
            f"aerie pipeline '{self.config.run}' ({self.config.preset}) — {self.seconds:.1f} s",
            f"{'stage':22s} {'time':>8s} {'cache':>6s}  figures",
        ]
        for r in self.results:
            figures = ", ".join(f"{k}={figure_text(v)}" for k, v in r.figures.items())
            lines.append(f"{r.stage:22s} {r.seconds:7.1f}s {'hit' if r.cache_hit else 'run':>6s}  {figures}")
            if (reasoning := reasoning_line(r.figures)) is not None:
                lines.append(f"{'':22s} {'':>8s} {'':>6s}  {reasoning}")
            if r.cache_hit and r.original_seconds is not None:
                figures = (
                    f"(this run {r.seconds:.1f} s; the stage took {r.original_seconds:.1f} s when it ran)"
                )
                lines.append(f"{'':22s} {'':>8s} {'':>6s}  {figures}")
            lines.append(f"{'':22s} {'':>8s} {'':>6s}  {r.manifest_uri}")
        if self.gpu_seconds is not None:
            lines.append(
                f"GPU time over every call: {self.gpu_seconds:.1f} s (estimates: figures estimate_s)"
            )
        return "\n".join(lines)


def figure_text(value: object) -> str:
    """A figure as a summary shows it. A nested figure (extraction's `phases`) would fill the line: it
    shows its three largest `share` leaves; the whole of it stays in the manifest."""
    if isinstance(value, dict):
        shares = sorted(_shares(value), key=lambda item: -item[1])[:3]
        inner = ", ".join(f"{path} {share:.2f}" for path, share in shares)
        return f"({inner or f'{len(value)} entries'}; see the manifest)"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:,}"
    return str(value)


def _shares(tree: dict[str, object], prefix: str = "") -> list[tuple[str, float]]:
    """(path, share) of every `{"share": x}` leaf of a nested figure."""
    found: list[tuple[str, float]] = []
    for key, value in tree.items():
        if key == "share" and isinstance(value, (int, float)):
            found.append((prefix.rstrip("."), float(value)))
        elif isinstance(value, dict):
            found += _shares(value, f"{prefix}{key}.")
    return found


def planned(cfg: PipelineConfig, until: str | None = None) -> list[Stage]:
    """The stages a run runs, in order: all of them, or up to and including `until`; a disabled stage
    (`evaluate.enabled`, `deploy.enabled` false) is left out."""
    if until is not None and until not in STAGE_NAMES:
        raise ConfigError(f"unknown stage {until!r}; stages: {', '.join(STAGE_NAMES)}")
    wanted = STAGES[: STAGE_NAMES.index(until) + 1] if until else STAGES
    return [stage for stage in wanted if stage.enabled(cfg)]


StepFn = Callable[[StageJob], list[StageResult]]


def choose_source(cfg: PipelineConfig, plan: Plan | None) -> PipelineConfig:
    """`train.source: auto` decided once, before any stage runs: what the plan recommends
    (`aerie.plan.online`: online when a disk cannot hold the shards or it costs about the same, else
    shards). Without a plan (it could not be made) the shards, as before there was a choice."""
    if cfg.train.source != "auto":
        return cfg
    choice = online_plan.of_plan(plan) if plan is not None else None
    source = choice.choice if choice is not None else "shards"
    log.info("train.source auto: %s (%s)", source, choice.reason if choice else "no plan to decide by")
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"source": source})})


def resolve(cfg: PipelineConfig, target: TargetInfo, plan: Plan | None) -> PipelineConfig:
    """The run's config with every cross-section setting derived, once, before any stage runs:
    `train.source: auto` decided by the plan, then each stage's own section completed
    (`Stage.resolve`). Every stage of the run reads this config, and only its own section of it."""
    cfg = choose_source(cfg, plan)
    for stage in STAGES:
        cfg = stage.resolve(cfg, target)
    return cfg


def compose(
    cfg: PipelineConfig,
    ctx: StageContext,
    step: StepFn,
    *,
    until: str | None = None,
    plan: Plan | None = None,
) -> list[StageResult]:
    """Every planned stage in order, each fed the results before it through its job (`StageJob`,
    made here once per stage). `step` runs one job: here `stage.run` itself, under Prefect a subflow
    (`flows.pipeline`). Its results are every run's."""
    stages = planned(cfg, until)
    upstream = Upstream()
    results: list[StageResult] = []
    for i, stage in enumerate(stages):
        job = stage.job(
            cfg, replace(ctx, rebuild_missing=rebuild_missing(cfg, ctx, stages, i, upstream)), upstream
        )
        # The one place every stage of every run passes through: its estimate before, the actual after.
        track.before(plan, stage.name)
        prediction = stage.predict(job)
        done = track.after(plan, ctx.store, stage.name, step(job))
        done = stage.with_prediction(prediction, done)
        plan = track.refined(plan, stage.name, done)
        results += done
        upstream = upstream.plus(stage.name, done)
    return results


def rebuild_missing(
    cfg: PipelineConfig, ctx: StageContext, stages: Sequence[Stage], i: int, upstream: Upstream
) -> bool:
    """Whether stage `i` makes a finished output whole again where part of it is gone (extraction's
    shards, `ExtractStage.needs`): yes when this run stops at it or the stage after it has work to do.
    Evaluation and deployment read the drafter, never the shards, so a host that got a finished
    drafter without its shards (a store copied without them) evaluates and deploys it straight away."""
    if i + 1 == len(stages):
        return True
    this = stages[i]
    finished = this.cached(this.job(cfg, ctx, upstream))
    if finished is None:  # not done yet: it runs anyway
        return True
    after = stages[i + 1]
    return after.needs(after.job(cfg, ctx, upstream.plus(this.name, finished)))


def run_pipeline(
    cfg: PipelineConfig,
    *,
    until: str | None = None,
    progress: ProgressFactory = terminal_progress,
    store: ArtifactStore | None = None,
) -> PipelineReport:
    """Run every stage in order (or up to and including `until`); each resumes from its manifest."""
    planned(cfg, until)  # an unknown stage fails before anything starts
    started = time.monotonic()
    store = store or open_store(cfg.store)
    check_secrets(cfg, store)
    ctx = StageContext(store=store, run=cfg.run, target=resolve_target(cfg.target), progress=progress)
    cfg = resolve(cfg, ctx.target, plan := track.plan_for(cfg))
    results = compose(cfg, ctx, lambda job: job.stage.run(job), until=until, plan=plan)
    return PipelineReport(
        config=cfg,
        results=results,
        seconds=time.monotonic() - started,
        gpu_seconds=track.gpu_seconds(plan, store, results),
    )


def missing_secrets(cfg: PipelineConfig, store: ArtifactStore) -> list[str]:
    """What this run needs from the environment and does not have, every one of them, one line each
    (variable names, never values): AWS credentials for an S3 store, and the endpoint's API key when a
    dataset still has to be generated through an endpoint that is not on this machine."""
    from aerie.generate.work import read_api_key

    missing = []
    if cfg.store.uri.startswith("s3://"):
        import boto3

        if boto3.Session().get_credentials() is None:
            missing.append(
                f"no AWS credentials for the store {cfg.store.uri}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment or .env"
            )
    endpoint = cfg.generate.endpoint
    remote = endpoint.base_url is not None and _host_of(endpoint.base_url) not in _LOCAL_HOSTS
    # Whether generation is still pending is read from the store; a store without its credentials
    # cannot say, so the key is named too (else the second secret would be found only on the next try).
    if remote and read_api_key(endpoint.api_key_env) is None and (missing or generation_pending(cfg, store)):
        missing.append(
            f"{endpoint.api_key_env} is not set: generation through {endpoint.base_url} needs it "
            "(set it in the environment or in .env, see .env.example)"
        )
    return missing


_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0"})


def _host_of(url: str) -> str:
    from urllib.parse import urlsplit

    return (urlsplit(url).hostname or "").lower()


def check_secrets(cfg: PipelineConfig, store: ArtifactStore) -> None:
    """Refuse to start a run that would fail later for want of a secret (before any stage starts, and
    before the target is resolved: a missing key must not wait for a download)."""
    if missing := missing_secrets(cfg, store):
        head = (
            "a secret this run needs is missing"
            if len(missing) == 1
            else f"{len(missing)} secrets this run needs are missing"
        )
        raise ConfigError(f"{head}:\n  " + "\n  ".join(missing))
