"""Work functions called as their `Stage` calls them, for the tests that call one directly.

    run = staged("merge", corpus_work.run)
    run(cfg, store=store, run_name="r", target=target, inputs=[...])     # as the stage would

The StageDir is made here, as `Stage.stage_dir` makes it: the stage's own key function over the inputs
the work is given. A generation test names its dataset's StageDir with `dataset_dir`, and runs every
dataset of a config as the stage does with `generate_all`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from aerie.generate.config import DatasetSpec, GenerateConfig
from aerie.manifest import StageDir, StageResult
from aerie.progress import ProgressFn, no_progress
from aerie.stage import StageContext, WorkContext
from aerie.store import ArtifactStore
from aerie.targets import TargetInfo

R = TypeVar("R")
KeyFn = Callable[[Any, TargetInfo, dict[str, Any]], str]


def _merge_key(cfg: Any, target: TargetInfo, inputs: dict[str, Any]) -> str:
    from aerie.corpus.work import key_of

    return key_of(cfg, target, inputs["inputs"])


def _extract_key(cfg: Any, target: TargetInfo, inputs: dict[str, Any]) -> str:
    from aerie.extract.plan import extract_key

    return extract_key(cfg, inputs["server"], target, inputs["corpus"])


def _train_key(cfg: Any, target: TargetInfo, inputs: dict[str, Any]) -> str:
    from aerie.train.work import key_of

    return key_of(
        cfg, target, inputs["shards"], inputs["corpus"], inputs.get("extract"), inputs.get("server")
    )


def _evaluate_key(cfg: Any, target: TargetInfo, inputs: dict[str, Any]) -> str:
    from aerie.evaluate.work import key_of

    return key_of(cfg, target, inputs["drafter"], inputs["corpus"])


def _deploy_key(cfg: Any, target: TargetInfo, inputs: dict[str, Any]) -> str:
    from aerie.deploy.work import key_of

    return key_of(cfg, inputs["server"], target, inputs["drafter"], inputs["evaluation"])


_KEYS: dict[str, KeyFn] = {
    "merge": _merge_key,
    "extract": _extract_key,
    "train": _train_key,
    "evaluate": _evaluate_key,
    "deploy": _deploy_key,
}
# What a work function is given but its key is not decided by.
_NOT_KEYED = {"rebuild_missing"}


def staged(stage: str, work: Callable[..., R]) -> Callable[..., R]:
    """`work` (`work(cfg, *args, ctx, **inputs)`) taking the store, run, target and progress a stage
    has: `call(cfg, *args, store=, run_name=, target=, progress=, **inputs)`."""
    key_of = _KEYS[stage]

    def call(
        cfg: Any,
        *args: Any,
        store: ArtifactStore,
        run_name: str,
        target: TargetInfo,
        progress: ProgressFn = no_progress,
        **inputs: Any,
    ) -> R:
        keyed = {name: value for name, value in inputs.items() if name not in _NOT_KEYED}
        out = StageDir(store, run_name, stage, key_of(cfg, target, keyed))
        return work(cfg, *args, WorkContext(stage_dir=out, target=target, progress=progress), **inputs)

    return call


def dataset_dir(store: ArtifactStore, run_name: str, cfg: GenerateConfig, spec: DatasetSpec) -> StageDir:
    """One dataset's StageDir (`generate-<dataset>`), as the generation stage makes it."""
    from aerie.generate.work import key_of, stage_name

    return StageDir(store, run_name, stage_name(spec), key_of(cfg, spec))


def generate_all(cfg: GenerateConfig, store: ArtifactStore, run_name: str) -> list[StageResult]:
    """Every dataset of `cfg` as the generation stage runs them (`GENERATE.run`: in parallel up to the
    limit, the endpoint checked once), against `cfg.endpoint.base_url`. The stage reads its target only
    to launch an endpoint of its own, so none is given (a launch would fail on the missing fields)."""
    from aerie.config import PipelineConfig
    from aerie.generate.stage import GENERATE

    target = TargetInfo.model_construct(name="(none: generation against the configured endpoint)")
    ctx = StageContext(store=store, run=run_name, target=target)
    return GENERATE.run(GENERATE.job(PipelineConfig(run=run_name, generate=cfg), ctx))
