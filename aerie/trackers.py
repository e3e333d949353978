"""Experiment trackers: TensorBoard, MLflow and W&B behind one `Tracker` protocol.

`train.report_to` names them (none by default). The train stage reports each logged step's loss,
learning rate and tokens/s, each held-out evaluation's acceptance per position, and the run's config
and provenance as parameters; the evaluate and deploy stages report their headline figures (the
manifest's `figures`) the same way. Each tracker's package is an optional extra (`pip install
'aerie[trackers]'`), imported only when named; a named one that is missing fails before any work.

Where they write: `train.tracking_dir`, by default `<store>/<run>/trackers/` for a local store and
`<cache>/trackers/<run>/` for an S3 one (trackers write local files):

    tensorboard/<stage>-<key>/events.out.tfevents.*   `tensorboard --logdir DIR/tensorboard`
    mlflow.db                                        experiment `<run>`, one MLflow run per stage key
                                                     (`mlflow ui --backend-store-uri sqlite:///DIR/mlflow.db`;
                                                     MLFLOW_TRACKING_URI, when set, is used instead)
    wandb/offline-run-*                              W&B offline runs, project `aerie`, group `<run>`
                                                     (`wandb sync`); WANDB_MODE=online streams instead

A stage run that resumes (a stopped training) continues its tracker run: MLflow's is found by its
`aerie.key` tag, W&B's id is the stage key, and TensorBoard drops its own events from the resumed step
on (those steps are logged again), so each curve has one point per step.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol

from aerie.errors import ConfigError
from aerie.manifest import StageDir
from aerie.settings import get_settings
from aerie.version import __version__

if TYPE_CHECKING:
    from aerie.config import PipelineConfig

TrackerName = Literal["tensorboard", "mlflow", "wandb"]
# The module each tracker imports, and the package pip installs it from (the `trackers` extra).
PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("torch.utils.tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "wandb": ("wandb", "wandb"),
}
WANDB_PROJECT = "aerie"


class Tracker(Protocol):
    """One experiment tracker's run: parameters once, metrics by step, closed at the end."""

    name: str

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class Trackers:
    """Every tracker a stage reports to (none: each call does nothing), used as a context manager."""

    def __init__(self, trackers: Iterable[Tracker] = ()) -> None:
        self.trackers = list(trackers)

    def log_params(self, params: dict[str, Any]) -> None:
        flat = flatten(params)
        for t in self.trackers:
            t.log_params(flat)

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        numbers = numeric(metrics)
        if numbers:
            for t in self.trackers:
                t.log_metrics(numbers, step)

    def close(self) -> None:
        for t in self.trackers:
            t.close()
        self.trackers = []

    def __enter__(self) -> Trackers:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def open_trackers(
    report_to: Iterable[str], tracking_dir: str | None, stage_dir: StageDir, *, first_step: int = 0
) -> Trackers:
    """The trackers `report_to` names, each with a run for the stage `stage_dir` (continued if one exists)."""
    names = list(dict.fromkeys(report_to))
    if not names:
        return Trackers()
    check_installed(names)
    root = tracking_root(tracking_dir, stage_dir)
    opened: list[Tracker] = []
    for name in names:
        opened.append(_OPENERS[name](root, stage_dir, first_step))
    return Trackers(opened)


def check_installed(names: Iterable[str]) -> None:
    """A named tracker whose package is missing, named with the install line (before any work)."""
    for name in names:
        if name not in PACKAGES:
            raise ConfigError(f"train.report_to: unknown tracker {name!r} (known: {', '.join(PACKAGES)})")
        module, package = PACKAGES[name]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                f"train.report_to names {name}, whose package {package} is not installed: "
                f"pip install 'aerie[trackers]' (or {package})"
            ) from exc


def tracking_root(tracking_dir: str | None, stage_dir: StageDir) -> Path:
    """`tracking_dir`, or beside the run in a local store, or under the cache for a remote store."""
    if tracking_dir:
        root = Path(tracking_dir).expanduser()
    else:
        local = stage_dir.store.local_path(f"{stage_dir.run}/trackers")
        root = local if local is not None else get_settings().cache_dir / "trackers" / stage_dir.run
    root.mkdir(parents=True, exist_ok=True)
    return root


def run_name(stage_dir: StageDir) -> str:
    return f"{stage_dir.stage}-{stage_dir.key}"


def provenance(stage_dir: StageDir, **more: Any) -> dict[str, Any]:
    """What identifies a stage's run: aerie's version, the run, the stage, its key and output URI."""
    return {
        "aerie_version": __version__,
        "run": stage_dir.run,
        "stage": stage_dir.stage,
        "key": stage_dir.key,
        "output": stage_dir.uri(""),
        **more,
    }


@dataclass(frozen=True)
class Tracking:
    """Which trackers a stage after training reports to, and where (the run's `train.report_to`)."""

    report_to: tuple[str, ...] = ()
    tracking_dir: str | None = None

    @classmethod
    def of(cls, cfg: PipelineConfig) -> Tracking:
        return cls(tuple(cfg.train.report_to), cfg.train.tracking_dir)

    def report(self, stage_dir: StageDir, figures: dict[str, Any], params: dict[str, Any]) -> None:
        """A stage's headline figures (at step 0) and its parameters, to each named tracker."""
        if not self.report_to:
            return
        with open_trackers(self.report_to, self.tracking_dir, stage_dir) as trackers:
            trackers.log_params(
                {**params, "provenance": provenance(stage_dir, **params.get("provenance", {}))}
            )
            trackers.log_metrics({f"{stage_dir.stage}/{k}": v for k, v in figures.items()}, step=0)


NO_TRACKING = Tracking()


def flatten(params: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested parameters as `a.b.c` -> text (lists as JSON), as every tracker stores them."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value)
    return flat


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of `metrics` (a list becomes one metric per position: `name/pos<i>`)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, list):
            out.update(numeric({f"{key}/pos{i}": v for i, v in enumerate(value)}))
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    return out


# ------------------------------------------------------------------------------------------- trackers


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, root: Path, stage_dir: StageDir, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = root / "tensorboard" / run_name(stage_dir)
        # purge_step: events at or past the resumed step, written before the stop, are dropped.
        self.writer = SummaryWriter(str(self.dir), purge_step=first_step or None)

    def log_params(self, params: dict[str, Any]) -> None:
        rows = "\n".join(f"| {k} | {v} |" for k, v in params.items())
        self.writer.add_text("params", "| parameter | value |\n|---|---|\n" + rows)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class MlflowTracker:
    name = "mlflow"

    def __init__(self, root: Path, stage_dir: StageDir, first_step: int) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(stage_dir.run)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(stage_dir.run)
        )
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`aerie.key` = '{stage_dir.key}'"
        )
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {"aerie.key": stage_dir.key, "aerie.stage": stage_dir.stage, "aerie.run": stage_dir.run}
            run = self.client.create_run(experiment_id, run_name=run_name(stage_dir), tags=tags)
            self.run_id = run.info.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # A resumed run logs the same parameters again: MLflow refuses a changed value, keeps an equal one.
        logged = self.client.get_run(self.run_id).data.params
        fresh = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in logged]
        for i in range(0, len(fresh), 100):  # MLflow takes at most 100 parameters a batch
            self.client.log_batch(self.run_id, params=fresh[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_mlflow_key(k), v, now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    """MLflow keys allow letters, digits, `_-./` and spaces."""
    return "".join(c if c.isalnum() or c in "_-./ " else "_" for c in key)


class WandbTracker:
    name = "wandb"

    def __init__(self, root: Path, stage_dir: StageDir, first_step: int) -> None:
        import wandb

        (root / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=WANDB_PROJECT,
            group=stage_dir.run,
            name=run_name(stage_dir),
            id=f"{stage_dir.run}-{stage_dir.stage}-{stage_dir.key}"[:128],
            resume="allow",
            dir=str(root),
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
            job_type=stage_dir.stage,
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True),
            reinit="create_new",
        )

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        # W&B refuses a step below one it has logged (a resumed run's repeated steps): keyed by its own.
        self.run.log({**metrics, "step": step})

    def close(self) -> None:
        self.run.finish()


_OPENERS: dict[str, Any] = {
    "tensorboard": TensorBoardTracker,
    "mlflow": MlflowTracker,
    "wandb": WandbTracker,
}
