"""`serving.json`, shipped with a promoted drafter: how to serve it and what it is expected to give.

Written in two steps: `serving_plan` before any server starts (the prediction of `aerie.plan.served`
per concurrency tier, at the served accept length expected from the offline evaluation), then
`with_measured` after the serve (each tier's measured speed-up, accept length and spread beside it).
The format is documented in docs/serving.md.
"""

from __future__ import annotations

from typing import Any

from aerie.deploy.config import DeployConfig
from aerie.errors import ConfigError
from aerie.plan import served
from aerie.serving import ServerConfig, SpeculativeArgs
from aerie.sglang_plugin.compat import SUPPORTED_SGLANG

FORMAT = 1
# Where the launch arguments point at the drafter: the directory serving.json sits beside.
DRAFTER_DIR = "<promoted>/drafter"


def launch_args(algorithm: str, num_steps: int | None) -> list[str]:
    """SGLang's launch arguments for the drafter under its family's algorithm (`Family.served_algorithm`);
    an EAGLE-3 drafter as a chain of `num_steps` drafts. None: serve without speculation."""
    if num_steps is None:
        return []
    chain = algorithm == "EAGLE3"
    return SpeculativeArgs(
        draft_model_path=DRAFTER_DIR,
        algorithm=algorithm,
        num_steps=num_steps if chain else None,
        eagle_topk=1 if chain else None,
        num_draft_tokens=num_steps + 1 if chain else None,
    ).to_args()


def _expected_accept(figures: dict[str, Any], k: int) -> dict[str, Any] | None:
    found = served.evaluated_accept_length(figures, k)
    if found is None:
        return None
    value, how = served.served_accept_length(found[0])
    return {"offline": found[0], "offline_key": found[1], "served": round(min(value, k + 1.0), 4), "map": how}


def _tier(c: int, ests: dict[int, served.ServedEstimate], deployed: int, algorithm: str) -> dict[str, Any]:
    """One tier: the k with the highest predicted speed-up there (only among predicted ones)."""
    preds = {k: next(p for p in e.predictions if p.concurrency == c) for k, e in ests.items()}
    usable = {k: p for k, p in preds.items() if p.speedup is not None}
    if usable:
        k = max(usable, key=lambda k: usable[k].speedup or 0.0)
        best = usable[k]
        pays = (best.speedup or 0.0) > 1.0
        rng = best.speedup_range
        return {
            "concurrency": c,
            "predicted_speedup": round(best.speedup or 0.0, 3),
            "predicted_speedup_range": None if rng is None else [round(rng[0], 3), round(rng[1], 3)],
            "break_even_accept_length": round(best.break_even, 3),
            "num_steps": k if pays else None,
            "launch_args": launch_args(algorithm, k if pays else None),
            "flags": [*ests[k].flags, *best.flags],
            "why": f"k={k} predicts the most"
            if pays
            else "no k predicts a speed-up: serve without speculation",
        }
    p = preds.get(deployed) or next(iter(preds.values()))
    return {
        "concurrency": c,
        "predicted_speedup": None,
        "predicted_speedup_range": None,
        "break_even_accept_length": None if p.refused else round(p.break_even, 3),
        # Nothing recommended from a prediction that was not made: the measured serve may fill it.
        "num_steps": None,
        "launch_args": None,
        "flags": [],
        "why": p.refused or "no evaluated accept length: not predicted",
    }


def serving_plan(
    cfg: DeployConfig, server: ServerConfig, target: Any, figures: dict[str, Any], algorithm: str
) -> dict[str, Any]:
    """The prediction, per tier (each benchmarked concurrency), before the serve; `algorithm` is the
    drafter family's SGLang algorithm."""
    head: dict[str, Any] = {
        "format": FORMAT,
        "target": getattr(target, "name", None),
        "engine": f"SGLang {'/'.join(SUPPORTED_SGLANG)}",
        "algorithm": algorithm,
        "deployed_num_steps": cfg.num_steps,
        "expected_concurrency": cfg.deciding_concurrency,
    }
    card = served.this_card()
    if server.device == "cpu" or card is None:
        head["predicted"] = None
        head["why_not_predicted"] = (
            "the cost model is SGLang's step and round times measured on GPUs; this serve ran on "
            f"{'a CPU' if server.device == 'cpu' else 'no GPU aerie recognises'}"
        )
        head["tiers"] = [
            {"concurrency": c, "predicted_speedup": None, "num_steps": None, "launch_args": None, "flags": []}
            for c in cfg.concurrency
        ]

        return head
    shape = served.shape_of_target(target)
    try:
        probe = served.estimate(shape, card, cfg.num_steps, cfg.concurrency)
    except ConfigError as exc:
        return {**head, "predicted": None, "why_not_predicted": str(exc), "tiers": []}
    ks = sorted({*(probe.measured or {}).get("k", []), cfg.num_steps})
    accepts = {k: a for k in ks if (a := _expected_accept(figures, k)) is not None}
    ests = {
        k: served.estimate(shape, card, k, cfg.concurrency, accepts[k]["served"] if k in accepts else None)
        for k in ks
    }
    return {
        **head,
        "predicted": True,
        "card": card,
        "measured_card": probe.measured_card,
        "source": probe.source,
        "basis": probe.basis,
        "measured": probe.measured,
        "accept_length": {str(k): a for k, a in accepts.items()},
        "break_even_accept_length": {
            str(k): {str(p.concurrency): round(p.break_even, 3) for p in e.predictions if not p.refused}
            for k, e in ests.items()
        },
        "tiers": [_tier(c, ests, cfg.num_steps, algorithm) for c in cfg.concurrency],
    }


def _measured_choice(
    tier: dict[str, Any], spec: dict[str, Any] | None, deployed: int | None, algorithm: str
) -> dict[str, Any]:
    """Where no prediction recommended a chain, the measured serve does: the deployed k where it paid
    at this tier, no speculation where it did not."""
    if tier.get("launch_args") is not None or spec is None or spec.get("speedup") is None:
        return {}
    pays = spec["speedup"] > 1.0
    return {
        "num_steps": deployed if pays else None,
        "launch_args": launch_args(algorithm, deployed if pays else None),
        "why": f"measured at k={deployed}: {spec['speedup']:.3f}x"
        + ("" if pays else ", slower than no speculation"),
    }


def with_measured(plan: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """The plan with what the serve measured at each tier (speed-up of the drafter and of n-gram
    speculation over the baseline, SGLang's accept length, the spread of the repetitions) and the
    server recommended at the user's concurrency."""
    rows = {(r["server"], r["concurrency"]): r for r in report.get("rows", [])}
    tiers = []
    for tier in plan.get("tiers", []):
        c = tier["concurrency"]
        spec, ngram = rows.get(("speculative", c)), rows.get(("ngram", c))
        tiers.append(
            {
                **tier,
                **_measured_choice(tier, spec, report.get("num_steps"), plan.get("algorithm", "EAGLE3")),
                "measured_num_steps": report.get("num_steps"),
                "measured_speedup": None if spec is None else spec.get("speedup"),
                "measured_accept_length": None if spec is None else spec.get("accept_length"),
                "measured_spread": None if spec is None else spec.get("spread"),
                "measured_ngram_speedup": None if ngram is None else ngram.get("speedup"),
            }
        )
    return {
        **plan,
        "tiers": tiers,
        "ngram": report.get("ngram"),
        "recommendation": report.get("recommendation"),
        "promotion": report.get("promotion"),
    }
