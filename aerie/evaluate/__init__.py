"""Evaluate and deploy a trained drafter: acceptance under speculative decoding, serving benchmark.

Stage entry points: `run(cfg, store=..., run_name=..., target=..., drafter=..., corpus=...)` (stage
`evaluate`) and `deploy(cfg, store=..., run_name=..., target=..., drafter=..., evaluation=...,
server=...)` (stage `deploy`). Attributes load lazily so that importing the config does not pull in
torch or transformers. The speculative decoder and its proposers live in `aerie.engine.speculative`.

    config.py         EvaluateConfig, DeployConfig
    prompts.py        MT-Bench and held-out prompts as token ids
    stage.py          run(): the offline evaluation stage
    bench.py          async /generate benchmark client (tokens/s, TTFT, ITL, accept length)
    deploy.py         deploy(): baseline vs speculative server, promotion
    report.py         markdown tables, acceptance plot
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "run": "aerie.evaluate.stage",
    "deploy": "aerie.evaluate.deploy",
    "decide_promotion": "aerie.evaluate.deploy",
    "SpecDecoder": "aerie.engine.speculative.decoder",
    "SpecStats": "aerie.engine.speculative.decoder",
    "PromptLookupProposer": "aerie.engine.speculative.prompt_lookup",
    "EagleProposer": "aerie.engine.speculative.eagle",
    "benchmark": "aerie.evaluate.bench",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'aerie.evaluate' has no attribute {name!r}")
