"""The whole pipeline without Prefect: stages in order, each fed its upstream results.

    generate-<dataset> (one per dataset) ─┐
                                          ├─> merge ─> extract ─> train ─> evaluate ─> deploy
    (the target, resolved once) ──────────┘

`flows/pipeline.py` composes the same stages as Prefect subflows; this module is what a GPU host
without a Prefect server runs (`aerie run PRESET --no-prefect [--until STAGE]`), and what the summary
is built from. Every stage caches on its manifest, so a re-run resumes where the last one stopped.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from aerie.config import PipelineConfig
from aerie.errors import ConfigError
from aerie.manifest import StageResult
from aerie.progress import ProgressFn, terminal_progress
from aerie.store import ArtifactStore, open_store
from aerie.targets import TargetInfo, resolve_target

STAGES = ("generate", "merge", "extract", "train", "evaluate", "deploy")

ProgressFactory = Callable[[str], ProgressFn]


@dataclass
class PipelineReport:
    """What a run produced: one StageResult per stage run, in order."""

    config: PipelineConfig
    results: list[StageResult] = field(default_factory=list)
    seconds: float = 0.0

    def table(self) -> str:
        """The one summary `make run` ends with: stage, time, cache hit, key figures, artifact path."""
        lines = [
            f"aerie pipeline '{self.config.run}' ({self.config.preset}) — {self.seconds:.1f} s",
            f"{'stage':22s} {'time':>8s} {'cache':>6s}  figures",
        ]
        for r in self.results:
            figures = ", ".join(f"{k}={figure_text(v)}" for k, v in r.figures.items())
            lines.append(f"{r.stage:22s} {r.seconds:7.1f}s {'hit' if r.cache_hit else 'run':>6s}  {figures}")
            if r.cache_hit and r.original_seconds is not None:
                figures = (
                    f"(this run {r.seconds:.1f} s; the stage took {r.original_seconds:.1f} s when it ran)"
                )
                lines.append(f"{'':22s} {'':>8s} {'':>6s}  {figures}")
            lines.append(f"{'':22s} {'':>8s} {'':>6s}  {r.manifest_uri}")
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


@contextlib.contextmanager
def generation_endpoint(cfg: PipelineConfig, target: TargetInfo) -> Iterator[str]:
    """The endpoint generation talks to: the configured one, or the reference server serving the
    target itself for the duration of generation (the embedded default)."""
    if cfg.generate.endpoint.base_url:
        yield cfg.generate.endpoint.base_url
        return
    from aerie.serving import ModelServer, spec_for

    server_cfg = cfg.server.model_copy(update={"backend": "reference", "launcher": "process"})
    spec = spec_for(
        server_cfg,
        model_path=target.path,
        mode="serve",
        extra_args=cfg.generate.endpoint.launch_args,
        trust_remote_code=target.trust_remote_code,
    )
    with ModelServer(spec) as server:
        yield f"{server.url}/v1"


def run_pipeline(
    cfg: PipelineConfig,
    *,
    until: str | None = None,
    progress: ProgressFactory = terminal_progress,
    store: ArtifactStore | None = None,
) -> PipelineReport:
    """Run every stage in order (or up to and including `until`); each resumes from its manifest."""
    # Stage modules are imported when their stage runs: `--until merge` on a CPU host needs no trainer.
    from aerie.generate.stage import run_all as generate_all

    if until is not None and until not in STAGES:
        raise ConfigError(f"unknown stage {until!r}; stages: {', '.join(STAGES)}")
    wanted = STAGES[: STAGES.index(until) + 1] if until else STAGES
    started = time.monotonic()
    store = store or open_store(cfg.store)
    check_secrets(cfg, store)
    target = resolve_target(cfg.target)
    report = PipelineReport(config=cfg)
    common: dict[str, Any] = {"store": store, "run_name": cfg.run, "target": target}

    def step(name: str, call: Callable[[], StageResult]) -> StageResult | None:
        if name not in wanted:
            return None
        result = call()
        report.results.append(result)
        return result

    generated = generate_all(
        cfg.generate,
        store=store,
        run_name=cfg.run,
        endpoint=lambda: generation_endpoint(cfg, target),
        progress=progress,
    )
    report.results.extend(generated)
    corpus = step(
        "merge",
        lambda: _stage("aerie.corpus.stage").run(
            cfg.corpus, inputs=generated, progress=progress("merge"), **common
        ),
    )
    shards = step(
        "extract",
        lambda: _stage("aerie.extract.stage").run(
            cfg.extract,
            corpus=_ok(corpus),
            server=cfg.server,
            progress=progress("extract"),
            rebuild_missing=shards_needed(cfg, wanted, _ok(corpus), **common),
            **common,
        ),
    )
    drafter = step(
        "train",
        lambda: _stage("aerie.train.stage").run(
            cfg.train, shards=_ok(shards), corpus=_ok(corpus), progress=progress("train"), **common
        ),
    )
    evaluation = step(
        "evaluate",
        lambda: _stage("aerie.evaluate.stage").run(
            cfg.evaluate, drafter=_ok(drafter), corpus=_ok(corpus), progress=progress("evaluate"), **common
        ),
    )
    if cfg.deploy.enabled:
        step(
            "deploy",
            lambda: _stage("aerie.evaluate.deploy").deploy(
                cfg.deploy,
                drafter=_ok(drafter),
                evaluation=_ok(evaluation),
                server=cfg.server,
                progress=progress("deploy"),
                **common,
            ),
        )
    report.seconds = time.monotonic() - started
    return report


def shards_needed(
    cfg: PipelineConfig,
    wanted: Sequence[str],
    corpus: StageResult,
    *,
    store: ArtifactStore,
    run_name: str,
    target: TargetInfo,
) -> bool:
    """Whether this run needs the hidden-state shards on hand, so that a finished extraction whose
    shards are gone makes them again (`extract.run(rebuild_missing=True)`): yes when it stops at
    extraction or its training has to run. Evaluation and deployment read the drafter, never the
    shards, so a GPU host that got a finished drafter back without its shards (they never travel,
    `tools.gpuhost`) evaluates and deploys it straight away."""
    if "train" not in wanted:
        return True
    from aerie.extract import stage as extract_stage
    from aerie.train import stage as train_stage  # torch: only where training is part of the run

    probe = extract_stage.stage_dir(cfg.extract, store, run_name, target, corpus, cfg.server).cached_result()
    if probe is None:  # not extracted yet: the extraction runs anyway
        return True
    return train_stage.stage_dir(cfg.train, store, run_name, target, probe, corpus).cached_result() is None


def _stage(module: str) -> Any:
    return importlib.import_module(module)


def _ok(result: StageResult | None) -> StageResult:
    # Stages run in order, so an upstream result is present whenever a downstream stage runs.
    assert result is not None
    return result


def generation_pending(cfg: PipelineConfig, store: ArtifactStore) -> bool:
    """True when some dataset still needs the target (so an embedded endpoint must be launched)."""
    from aerie.generate.stage import key_of, stage_name
    from aerie.manifest import StageDir

    return any(
        spec.regenerate
        and StageDir(store, cfg.run, stage_name(spec), key_of(cfg.generate, spec)).manifest() is None
        for spec in cfg.generate.datasets
    )


def missing_secrets(cfg: PipelineConfig, store: ArtifactStore) -> list[str]:
    """What this run needs from the environment and does not have, one line each (variable names, never
    values): the endpoint's API key when a dataset still has to be generated through an endpoint that
    is not on this machine, and AWS credentials for an S3 store."""
    from aerie.generate.stage import read_api_key

    missing = []
    endpoint = cfg.generate.endpoint
    remote = endpoint.base_url is not None and _host_of(endpoint.base_url) not in _LOCAL_HOSTS
    if remote and read_api_key(endpoint.api_key_env) is None and generation_pending(cfg, store):
        missing.append(
            f"{endpoint.api_key_env} is not set: generation through {endpoint.base_url} needs it "
            "(set it in the environment or in .env, see .env.example)"
        )
    if cfg.store.uri.startswith("s3://"):
        import boto3

        if boto3.Session().get_credentials() is None:
            missing.append(
                f"no AWS credentials for the store {cfg.store.uri}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment or .env"
            )
    return missing


_LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0"})


def _host_of(url: str) -> str:
    from urllib.parse import urlsplit

    return (urlsplit(url).hostname or "").lower()


def check_secrets(cfg: PipelineConfig, store: ArtifactStore) -> None:
    """Refuse to start a run that would fail later for want of a secret (before any stage starts)."""
    if missing := missing_secrets(cfg, store):
        raise ConfigError("; ".join(missing))
