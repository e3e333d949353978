"""Prefect flows of the generation stage: one subflow per dataset, datasets in parallel up to a limit.

Thin on purpose: `aerie.generate.work.run` does the work. The generation task retries (a re-run
resumes from the journal, so a retry costs only the requests in flight), except for errors that a
retry cannot fix: a rejected key, a wrong URL or model, a bad config. Each dataset gets a progress
artifact and a table of its figures; `generate_all` adds one table over all datasets. The task is
cached on the stage key (dataset spec, sampling, model); the stage's own manifest makes a re-run a
hit even without Prefect.

Subflows are called from a thread pool: Prefect runs a sync subflow called directly to completion
before the next, and each thread gets a copy of the parent's context so the subflow runs appear
under `generate-all` in the UI.
"""

from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.context import TaskRunContext

from aerie.errors import (
    ConfigError,
    DataError,
    EndpointAuthError,
    EndpointError,
    EndpointRequestError,
    EndpointUnreachableError,
)
from aerie.generate import work as generate_work
from aerie.generate.config import DatasetSpec, GenerateConfig
from aerie.generate.interrupt import wait_or_interrupt
from aerie.manifest import StageDir, StageResult
from aerie.store import StoreConfig, open_store

from .reporting import artifact_key, notify_failure, prefect_progress, stage_table
from .retrying import retry_unless
from .stagecache import cache_key, run_cached

# A missing or malformed source fails the same way on every attempt (DataError covers both); an
# endpoint that the check before generation found dead is named in seconds, not after minutes of retries.
NOT_RETRIED = (EndpointAuthError, EndpointRequestError, EndpointUnreachableError, ConfigError, DataError)


# Retry transient trouble (an outage that exhausted the request retries, a full failure budget); never
# a rejected key or request, a bad config or bad source data, which fail the same way again.
_worth_retrying = retry_unless(*NOT_RETRIED)


def _cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """The library's own stage key (what decides the output, worked out by the subflow), plus where
    the output lives."""
    spec: DatasetSpec = parameters["spec"]
    key = parameters["key"]
    return cache_key(f"generate-{spec.name}", parameters["store_cfg"].uri, parameters["run_name"], key)


@task(
    name="generate-conversations",
    cache_key_fn=_cache_key,
    persist_result=True,
    retries=2,
    retry_delay_seconds=[30, 120],
    retry_condition_fn=_worth_retrying,
)
def generate_task(
    cfg: GenerateConfig,
    spec: DatasetSpec,
    store_cfg: StoreConfig,
    run_name: str,
    base_url: str | None,
    key: str,
) -> StageResult:
    stage = generate_work.stage_name(spec)
    progress = prefect_progress(artifact_key(run_name, stage), f"generating {spec.name}")
    out = StageDir(open_store(store_cfg), run_name, stage, key)
    return generate_work.run(cfg, spec, out, base_url=base_url, progress=progress)


@flow(
    name="generate-dataset",
    flow_run_name="generate-{spec.name}",
    on_failure=[notify_failure],
    on_crashed=[notify_failure],
)
def generate_dataset(
    cfg: GenerateConfig,
    spec: DatasetSpec,
    store_cfg: StoreConfig,
    run_name: str,
    base_url: str | None = None,
    key: str | None = None,
) -> StageResult:
    """Regenerate one dataset with the target; returns the stage result (a pointer). `key`: the
    dataset's key where the caller has worked it out (the pipeline has), else it is worked out here."""
    # Worked out at most once (it hashes the source file): the task and its cache key are handed it.
    if key is None:
        key = generate_work.key_of(cfg, spec)
    result = run_cached(
        generate_task,
        open_store(store_cfg),
        cfg=cfg,
        spec=spec,
        store_cfg=store_cfg,
        run_name=run_name,
        base_url=base_url,
        key=key,
    )
    f = result.figures
    stage_table(
        result,
        f"{result.stage}: {f.get('records')} conversations, {f.get('failed')} failed, "
        f"{f.get('completion_tokens')} completion tokens",
    )
    return result


@flow(name="generate-all", on_failure=[notify_failure], on_crashed=[notify_failure])
def generate_all(
    cfg: GenerateConfig,
    store_cfg: StoreConfig,
    run_name: str,
    base_url: str | None = None,
    keys: list[str] | None = None,
) -> list[StageResult]:
    """Every dataset of `cfg`, up to `cfg.max_parallel_datasets` subflows at a time. A failing
    dataset does not stop the others; the first failure is raised once all have ended. `keys`: the
    datasets' keys in config order, where the caller has worked them out."""
    names = [spec.name for spec in cfg.datasets]
    if len(set(names)) != len(names):
        raise ConfigError(f"generate.datasets: dataset names must be unique, got {names}")
    if keys is not None and len(keys) != len(cfg.datasets):
        raise ConfigError(f"generate-all: {len(keys)} keys for {len(cfg.datasets)} datasets")
    pool = ThreadPoolExecutor(max_workers=cfg.max_parallel_datasets, thread_name_prefix="generate")
    try:
        futures = [
            pool.submit(
                contextvars.copy_context().run,
                generate_dataset,
                cfg=cfg,
                spec=spec,
                store_cfg=store_cfg,
                run_name=run_name,
                base_url=base_url,
                key=keys[i] if keys is not None else None,
            )
            for i, spec in enumerate(cfg.datasets)
        ]
        # Ctrl-C: the datasets' requests are cancelled and one line says what each kept.
        wait_or_interrupt(futures, generate_work.cancel_running)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    outcomes: list[StageResult | BaseException] = []
    for future in futures:
        try:
            outcomes.append(future.result())
        except Exception as exc:  # collected: the other datasets kept running
            outcomes.append(exc)
    results = [o for o in outcomes if isinstance(o, StageResult)]
    create_table_artifact(
        [_row(spec, outcome) for spec, outcome in zip(cfg.datasets, outcomes, strict=True)],
        key=artifact_key(run_name, "generate-datasets"),
        description=f"generation: {len(results)} of {len(outcomes)} datasets complete",
    )
    errors = [
        (spec.name, o)
        for spec, o in zip(cfg.datasets, outcomes, strict=True)
        if not isinstance(o, StageResult)
    ]
    if len(errors) == 1:
        raise errors[0][1]
    if errors:
        raise EndpointError(f"{len(errors)} datasets failed; " + "; ".join(f"{n}: {e}" for n, e in errors))
    return results


def _row(spec: DatasetSpec, outcome: StageResult | BaseException) -> dict[str, Any]:
    if not isinstance(outcome, StageResult):
        return {"dataset": spec.name, "status": f"failed: {type(outcome).__name__}"}
    f = outcome.figures
    return {
        "dataset": spec.name,
        "status": "cached" if outcome.cache_hit else "generated",
        "records": f.get("records"),
        "failed": f.get("failed"),
        "skipped": f.get("skipped"),
        "prompt tokens": f.get("prompt_tokens"),
        "completion tokens": f.get("completion_tokens"),
        "cost (USD)": f.get("cost_usd"),
        "requests/s": f.get("requests_per_s"),
        "tokens/s": f.get("tokens_per_s"),
        "manifest": outcome.manifest_uri,
    }
