"""Evaluate a trained drafter offline: lossless speculative decoding and its acceptance.

Stage entry point: `run(cfg, ctx, drafter=..., corpus=...)` (`ctx` the `aerie.stage.WorkContext`; stage
`evaluate`; `stage.EVALUATE` in the pipeline). Serving the drafter is the deploy stage (`aerie.deploy`).
Attributes load lazily so that importing the config does not pull in torch or transformers. The
speculative decoder and its proposers live in `aerie.engine.speculative`.

    config.py         EvaluateConfig
    prompts.py        MT-Bench and held-out prompts as token ids
    work.py           run(): the offline evaluation stage
    stage.py          EVALUATE: the stage in the pipeline
    report.py         markdown tables, acceptance plot
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "run": "aerie.evaluate.work",
    "SpecDecoder": "aerie.engine.speculative.decoder",
    "SpecStats": "aerie.engine.speculative.decoder",
    "PromptLookupProposer": "aerie.engine.speculative.prompt_lookup",
    "EagleProposer": "aerie.engine.speculative.eagle",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'aerie.evaluate' has no attribute {name!r}")
