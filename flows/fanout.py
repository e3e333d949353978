"""A stage's parts through a Prefect deployment: one flow run per part still to do, each on the host
whose worker takes it (extraction's slices through `extract.slice_deployment`, e.g. "extract-slice/slice-gpu",
prefect.yaml), all started at once, linked as subflows of the stage's, then waited for. A part whose run
did not complete comes back as the stage's `part_error` naming the part, its run and its final state;
a completed one as its `StagePart` (its record is in the store, where the stage's `assemble` reads it)."""

from __future__ import annotations

import time
from typing import Any, cast
from uuid import UUID

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from pydantic import BaseModel

from aerie.errors import ConfigError
from aerie.stage import PartsRunner, Stage, StageJob, StagePart

POLL_S = 5.0  # how often the stage's flow looks at its parts' runs


def through_deployment(deployment: str, job: StageJob) -> PartsRunner:
    """A runner (`aerie.stage.run_parts`) that starts a run of `deployment` per part and waits for all."""
    stage, cfg = job.stage, job.cfg

    def runner(todo: list[StagePart], shared: Any) -> list[BaseModel | BaseException]:
        logger = get_run_logger()
        logger.info("%s: %d parts to run through %s", stage.name, len(todo), deployment)
        params = {
            "stage": stage.name,
            "cfg": cfg,
            "target": job.ctx.target,
            "upstream": job.upstream,
            "shared": shared,
        }
        runs = {part.index: _start(deployment, params, part, f"{cfg.run}-{part.name}") for part in todo}
        done = _wait(runs)
        return [_outcome(stage, deployment, part, done[part.index]) for part in todo]

    return runner


def _start(deployment: str, params: dict[str, Any], part: StagePart, run_name: str) -> FlowRun:
    """Create the part's flow run (a subflow of this one) and return without waiting for it."""
    parameters = {
        name: value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        for name, value in {**params, "part": part}.items()
    }
    try:
        run = run_deployment(deployment, parameters=parameters, flow_run_name=run_name, timeout=0)
    except ObjectNotFound as exc:
        raise ConfigError(
            f"{deployment!r} is not a deployment on this Prefect server "
            "(prefect --no-prompt deploy --name <name>, see prefect.yaml)"
        ) from exc
    return cast(FlowRun, run)  # called from a sync flow, run_deployment runs synchronously


def _wait(runs: dict[int, FlowRun]) -> dict[int, FlowRun]:
    """Poll the parts' runs until every one is in a final state."""
    pending: dict[int, UUID] = {k: run.id for k, run in runs.items()}
    done: dict[int, FlowRun] = {}
    logger = get_run_logger()
    with get_client(sync_client=True) as client:
        while pending:
            for k, run_id in list(pending.items()):
                run = client.read_flow_run(run_id)
                if run.state is not None and run.state.is_final():
                    done[k] = run
                    del pending[k]
                    logger.info("flow run %s is %s", run.name, _state_line(run))
            if pending:
                time.sleep(POLL_S)
    return done


def _outcome(stage: Stage, deployment: str, part: StagePart, run: FlowRun) -> BaseModel | BaseException:
    if run.state is not None and run.state.is_completed():
        return part
    return stage.part_error(
        f"{part.label} (flow run {run.name!r}, {run.id}) through {deployment} did not complete: "
        f"{_state_line(run)}"
    )


def _state_line(run: FlowRun) -> str:
    if run.state is None:
        return "no state"
    message = (run.state.message or "").splitlines()
    return f"{run.state.type.value}" + (f": {message[0]}" if message else "")
