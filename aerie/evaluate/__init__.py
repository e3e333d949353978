"""Evaluate and deploy a trained drafter: lossless speculative decoding, acceptance, serving benchmark.

Stage entry points: `run(cfg, store=..., run_name=..., target=..., drafter=..., corpus=...)` (stage
`evaluate`) and `deploy(cfg, store=..., run_name=..., target=..., drafter=..., evaluation=...,
server=...)` (stage `deploy`). Attributes load lazily so that importing the config does not pull in
torch or transformers.

    config.py         EvaluateConfig, DeployConfig
    spec_decode.py    SpecDecoder: batched greedy speculative decoding, acceptance accounting
    prompt_lookup.py  the training-free n-gram proposer
    eagle.py          the EAGLE-3 drafter as a batched proposer
    spec_backend.py   the reference server's speculative mode (create_backend seam)
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
    "SpecDecoder": "aerie.evaluate.spec_decode",
    "SpecStats": "aerie.evaluate.spec_decode",
    "PromptLookupProposer": "aerie.evaluate.prompt_lookup",
    "EagleProposer": "aerie.evaluate.eagle",
    "benchmark": "aerie.evaluate.bench",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'aerie.evaluate' has no attribute {name!r}")
