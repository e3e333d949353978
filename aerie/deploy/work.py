"""The deploy stage: serve the drafter with speculative decoding, benchmark it against the same server
without speculation on the same prompts, promote the drafter only if it pays.

    <run>/deploy/<key>/report.json, report.md, manifest.json (last)
    <run>/promoted/drafter/*, report.md, report.json, evaluation.md, promotion.json   when promoted

The servers are launched one after the other on the configured port through `aerie.serving.ModelServer`
(readiness, launch nonce, teardown), so they never compete for the device: SGLang (docker or process)
with `--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR --speculative-num-steps K
--speculative-eagle-topk 1 --speculative-num-draft-tokens K+1`, or the reference server with the
same flags it supports. The benchmark client is `aerie.deploy.bench` against `/generate`.

Beside them, on SGLang, SGLang's own n-gram speculation (`--speculative-algorithm NGRAM`, no drafter;
`deploy.ngram`): a drafter that free n-gram lookup beats is never promoted. The reference server speaks
EAGLE-3 only, so there n-gram speculation is not served and the report says so. Every SGLang launch gets
`--max-running-requests` of the highest level: SGLang caps a speculative server at 48 otherwise, and
the baseline beside it must batch the same.

Each level runs at steady state, repeated (`aerie.deploy.bench`); the prediction of the cost model
(`aerie.plan.served`) is written to `prediction.json` before any server starts.

Promotion: the speed-up (speculative output tokens/s over the baseline's) at the deciding concurrency
level (`expected_concurrency`, else `promote_concurrency`, else the lowest benchmarked: speculative
decoding pays at low batch, large batches are compute-bound and the baseline catches up) must reach
`promote_margin`, and the n-gram server must not serve faster there. The promoted drafter carries
`serving.json` (docs/serving.md): per tier the predicted and measured speed-up, the break-even
acceptance and the recommended SGLang launch arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aerie.deploy.bench import TTFT_METHOD, LevelResult, benchmark, engine_accept_length
from aerie.deploy.config import DeployConfig
from aerie.deploy.report import deployment_markdown
from aerie.deploy.serving_plan import serving_plan, with_measured
from aerie.draft.card import update_card
from aerie.errors import EvaluationError, TargetError
from aerie.evaluate.drafter_files import drafter_keys, fetch_drafter, name_in_drafter
from aerie.evaluate.drafter_files import family_of as family_at
from aerie.evaluate.prompts import mtbench_prompts
from aerie.families import family
from aerie.manifest import StageResult, stage_key
from aerie.progress import ProgressFn
from aerie.serving import ModelServer, ServerConfig, ServerSpec, SpeculativeArgs, spec_for
from aerie.serving.spec import NGRAM
from aerie.stage import WorkContext
from aerie.store import ArtifactStore
from aerie.targets import TargetInfo, read_config
from aerie.trackers import NO_TRACKING, Tracking
from aerie.workdirs import work_dir

STAGE = "deploy"
PROMOTED = "promoted"
# Server fields that say where a server runs, not what it computes: kept out of the stage key.
_SERVER_NOT_KEYED = {"port", "host", "python", "startup_timeout_s", "grace_s", "poll_interval_s", "hf_cache"}


@dataclass(frozen=True)
class Promotion:
    promoted: bool
    reason: str
    concurrency: int
    speedup: float | None


def speculative_args(cfg: DeployConfig, server: ServerConfig, drafter_dir: str) -> SpeculativeArgs:
    """The speculative flags for the configured backend, under the drafter's family's algorithm (its
    `aerie.json` names the family). SGLang gets all three (topk 1 is a chain of num_steps drafts
    verified as num_steps+1 tokens); the reference server decodes chains and takes only the step count."""
    algorithm = family(family_at(Path(drafter_dir))).served_algorithm
    if server.backend == "sglang":
        return SpeculativeArgs(
            algorithm=algorithm,
            draft_model_path=drafter_dir,
            num_steps=cfg.num_steps,
            eagle_topk=cfg.eagle_topk,
            num_draft_tokens=cfg.num_draft_tokens or cfg.num_steps + 1,
        )
    if cfg.eagle_topk != 1:
        raise EvaluationError(
            f"deploy.eagle_topk {cfg.eagle_topk}: the reference server drafts chains only (topk 1); "
            "use server.backend=sglang for tree drafts"
        )
    return SpeculativeArgs(algorithm=algorithm, draft_model_path=drafter_dir, num_steps=cfg.num_steps)


def serves_ngram(cfg: DeployConfig, server: ServerConfig) -> bool:
    """Whether SGLang's n-gram speculation is served beside the drafter (the reference server has none)."""
    if cfg.ngram == "on" and server.backend != "sglang":
        raise EvaluationError(
            f"deploy.ngram on: the {server.backend} server speculates with an EAGLE-3 drafter only; n-gram "
            "speculation is measured on SGLang (server.backend=sglang), or set deploy.ngram auto"
        )
    return cfg.ngram != "off" and server.backend == "sglang"


def with_batch_room(server: ServerConfig, cfg: DeployConfig) -> ServerConfig:
    """SGLang launched with room for the highest level: its speculative launches default to 48 running
    requests (SGLang 0.5.23's speculative argument hook), which would queue a c64 level's requests while
    the baseline batched them all. A value in `server.extra_args` is kept."""
    if server.backend != "sglang" or "--max-running-requests" in server.extra_args:
        return server
    extra = [*server.extra_args, "--max-running-requests", str(max(cfg.concurrency))]
    return server.model_copy(update={"extra_args": extra})


def server_specs(
    cfg: DeployConfig, server: ServerConfig, target: TargetInfo, drafter_dir: str
) -> dict[str, ServerSpec]:
    """The baseline, speculative and (SGLang) n-gram launches (same backend, model and port; launched
    one at a time)."""
    server = with_batch_room(with_drafter_dtype(server, target, drafter_dir), cfg)
    ngram = (
        {
            "ngram": spec_for(
                server,
                model_path=target.path,
                mode="serve",
                name=f"{server.backend}-ngram",
                speculative=SpeculativeArgs(algorithm=NGRAM, num_draft_tokens=cfg.ngram_draft_tokens),
                trust_remote_code=target.trust_remote_code,
            )
        }
        if serves_ngram(cfg, server)
        else {}
    )
    return {
        "baseline": spec_for(
            server,
            model_path=target.path,
            mode="serve",
            name=f"{server.backend}-baseline",
            trust_remote_code=target.trust_remote_code,
        ),
        "speculative": spec_for(
            server,
            model_path=target.path,
            mode="serve",
            name=f"{server.backend}-eagle3",
            speculative=speculative_args(cfg, server, drafter_dir),
            trust_remote_code=target.trust_remote_code,
        ),
        **ngram,
    }


def with_drafter_dtype(server: ServerConfig, target: TargetInfo, drafter_dir: str) -> ServerConfig:
    """`server` serving both launches in the drafter's dtype where SGLang's `--dtype auto` would serve
    the target in another: it serves a float32 checkpoint (the embedded SmolLM2 is one) in float16, and
    the EAGLE-3 head then multiplies float16 hidden states by bfloat16 weights, which kills the
    speculative server at its first draft forward. The baseline gets the same dtype, so the two are
    compared like for like; a `--dtype` in `server.extra_args` is kept as it is."""
    if server.backend != "sglang" or "--dtype" in server.extra_args:
        return server
    drafter = _config_dtype(Path(drafter_dir))
    if drafter is None or _config_dtype(Path(target.path)) in (drafter, None):
        return server
    return server.model_copy(update={"extra_args": [*server.extra_args, "--dtype", drafter]})


def _config_dtype(model_dir: Path) -> str | None:
    """The dtype a model directory's config.json names (`dtype`, or `torch_dtype` before transformers
    5), or None where it names none or cannot be read."""
    try:
        config = read_config(model_dir)
    except TargetError:
        return None
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if isinstance(dtype, str) else None


def decide_promotion(rows: list[dict[str, Any]], cfg: DeployConfig) -> Promotion:
    """Promote when speculative tokens/s / baseline tokens/s >= promote_margin at the deciding level and
    SGLang's n-gram speculation (where served) is not faster there."""
    level = cfg.deciding_concurrency
    by = {(r["server"], r["concurrency"]): r for r in rows}
    spec, base = by.get(("speculative", level)), by.get(("baseline", level))
    if spec is None or base is None:
        return Promotion(False, f"no measurement of both servers at concurrency {level}", level, None)
    if not base["output_tokens_per_s"]:
        return Promotion(False, f"the baseline produced no tokens at concurrency {level}", level, None)
    speedup = spec["output_tokens_per_s"] / base["output_tokens_per_s"]
    verdict = speedup >= cfg.promote_margin
    reason = (
        f"speed-up {speedup:.3f}x at concurrency {level} "
        f"{'>=' if verdict else '<'} the margin {cfg.promote_margin:.3f}x"
    )
    ngram = by.get(("ngram", level))
    if verdict and ngram is not None and ngram["output_tokens_per_s"] > spec["output_tokens_per_s"]:
        verdict = False
        reason += (
            f", but SGLang's n-gram speculation serves faster there "
            f"({ngram['output_tokens_per_s'] / base['output_tokens_per_s']:.3f}x, no drafter needed)"
        )
    return Promotion(verdict, reason, level, round(speedup, 4))


def recommend(rows: list[dict[str, Any]], level: int) -> dict[str, Any]:
    """The server that served fastest at the user's concurrency, among those measured there."""
    at = [r for r in rows if r["concurrency"] == level and r["output_tokens_per_s"]]
    if not at:
        return {"concurrency": level, "server": None, "reason": f"nothing measured at concurrency {level}"}
    best = max(at, key=lambda r: r["output_tokens_per_s"])
    return {
        "concurrency": level,
        "server": best["server"],
        "output_tokens_per_s": best["output_tokens_per_s"],
        "speedup": best.get("speedup"),
        "reason": f"{best['server']} serves fastest at concurrency {level} ({_speeds(at)})",
    }


def key_of(
    cfg: DeployConfig,
    server: ServerConfig,
    target: TargetInfo,
    drafter: StageResult,
    evaluation: StageResult | None,
) -> str:
    # The default engine is left out, so runs keyed before the field existed keep their keys.
    keyed = {
        "deploy": cfg.model_dump(mode="json", exclude={"engine"} if cfg.engine == "sglang" else None),
        "server": server.model_dump(mode="json", exclude=_SERVER_NOT_KEYED),
    }
    upstream = [
        drafter.manifest_sha256,
        *([evaluation.manifest_sha256] if evaluation else []),
        target.revision,
    ]
    return stage_key(STAGE, keyed, upstream)


def deploy(
    cfg: DeployConfig,
    ctx: WorkContext,
    *,
    drafter: StageResult,
    evaluation: StageResult | None,
    server: ServerConfig,
    tracking: Tracking = NO_TRACKING,
) -> StageResult:
    """Benchmark the speculative server against the baseline; promote the drafter if it pays. Writes to
    `ctx.stage_dir` (keyed by `key_of` over these inputs)."""
    stage_dir, target, progress = ctx.stage_dir, ctx.target, ctx.progress
    store, run_name = stage_dir.store, stage_dir.run
    if (cached := stage_dir.cached_result()) is not None:
        return cached
    if not cfg.enabled:
        return stage_dir.finish({"enabled": False, "figures": {"deployed": False}})
    drafter_keys(store, drafter)  # a missing drafter fails here, before any server starts

    prompts = [p.input_ids for p in mtbench_prompts(target.load_tokenizer(), None, 4096)]
    prompts = [prompts[i % len(prompts)] for i in range(cfg.num_prompts)]
    figures_in = evaluation.figures if evaluation else {}
    with work_dir("aerie-deploy-") as tmp:
        drafter_dir = fetch_drafter(store, drafter, Path(tmp) / "drafter")
        # The prediction first, before any server starts: what the cost model expects is on record
        # whatever the serve then measures.
        algorithm = family(family_at(drafter_dir)).served_algorithm
        predicted = serving_plan(cfg, server, target, figures_in, algorithm)
        store.put_bytes(stage_dir.path("prediction.json"), json.dumps(predicted, indent=2).encode())
        specs = server_specs(cfg, server, target, str(drafter_dir))
        rows: list[dict[str, Any]] = []
        engine: dict[str, float | None] = {}
        outputs: dict[str, dict[int, list[list[int]]]] = {}
        for i, (name, spec) in enumerate(specs.items()):

            def report(fraction: float, message: str, base: float = i / len(specs)) -> None:
                progress(base + fraction / len(specs), message)

            results, outputs[name], engine[name] = _benchmark_server(name, spec, prompts, cfg, report)
            rows += [r.to_dict() for r in results]
    _add_speedups(rows)
    decision = decide_promotion(rows, cfg)
    same = _same_outputs(outputs)
    body: dict[str, Any] = {
        "target": {"name": target.name, "revision": target.revision},
        "drafter": f"{drafter.prefix}/drafter",
        "evaluation": evaluation.prefix if evaluation else None,
        "backend": server.backend,
        "servers": {name: {"command": spec.describe()} for name, spec in specs.items()},
        "ngram": "served" if "ngram" in specs else _no_ngram(cfg, server),
        "num_prompts": cfg.num_prompts,
        "max_new_tokens": cfg.max_new_tokens,
        "num_steps": cfg.num_steps,
        "steady_state": {
            "level_seconds": cfg.level_seconds,
            "requests_per_slot": cfg.requests_per_slot,
            "repeats": cfg.repeats,
        },
        "ttft_method": TTFT_METHOD,
        "rows": rows,
        "engine_accept_length": engine,
        "same_outputs": same,
        "prediction": predicted,
        "recommendation": recommend(rows, cfg.deciding_concurrency),
        "promotion": {
            "promoted": decision.promoted,
            "reason": decision.reason,
            "concurrency": decision.concurrency,
            "speedup": decision.speedup,
            "margin": cfg.promote_margin,
        },
    }
    if decision.promoted:
        body["promotion"]["promoted_prefix"] = store.uri(f"{run_name}/{PROMOTED}")
    markdown = deployment_markdown(body)
    store.put_bytes(stage_dir.path("report.json"), json.dumps(body, indent=2).encode())
    store.put_bytes(stage_dir.path("report.md"), markdown.encode())
    if decision.promoted:
        progress(0.99, "promoting the drafter")
        promote(store, run_name, drafter, evaluation, body, markdown)
    progress(1.0, decision.reason)
    result = stage_dir.finish({**body, "figures": _figures(rows, decision, same)})
    tracking.report(
        stage_dir,
        result.figures,
        {"deploy": cfg.model_dump(mode="json"), "provenance": {"drafter": drafter.prefix}},
    )
    return result


def _speeds(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"{r['server']} {r['output_tokens_per_s']:.1f} tok/s" for r in rows)


def _no_ngram(cfg: DeployConfig, server: ServerConfig) -> str:
    if cfg.ngram == "off":
        return "not served (deploy.ngram off)"
    return (
        f"not served: the {server.backend} server speculates with an EAGLE-3 drafter only; SGLang's "
        "n-gram speculation is measured on SGLang (server.backend=sglang)"
    )


def _benchmark_server(
    name: str, spec: ServerSpec, prompts: list[list[int]], cfg: DeployConfig, progress: ProgressFn
) -> tuple[list[LevelResult], dict[int, list[list[int]]], float | None]:
    def starting(fraction: float, message: str) -> None:
        progress(0.2 * fraction, f"{name}: {message}")

    with ModelServer(spec, progress=starting) as live:
        results, outputs = benchmark(
            live.url,
            name,
            prompts,
            cfg.concurrency,
            cfg.max_new_tokens,
            warmup=cfg.warmup_requests,
            timeout_s=cfg.request_timeout_s,
            progress=lambda f, m: progress(0.2 + 0.8 * f, m),
            seconds=cfg.level_seconds,
            requests_per_slot=cfg.requests_per_slot,
            repeats=cfg.repeats,
        )
        # SGLang's own running acceptance (/server_info), over the server's life, warm-up included.
        return results, outputs, engine_accept_length(live.url) if name != "baseline" else None


def _add_speedups(rows: list[dict[str, Any]]) -> None:
    base = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["server"] == "baseline"}
    for r in rows:
        b = base.get(r["concurrency"])
        r["speedup"] = round(r["output_tokens_per_s"] / b, 4) if b else None


def _same_outputs(outputs: dict[str, dict[int, list[list[int]]]]) -> dict[str, int]:
    """Prompts whose greedy output is identical on both servers (a lossless server agrees on all, up
    to floating-point differences between batch shapes on GPU)."""
    base = outputs.get("baseline", {})
    compared = identical = 0
    for name in ("speculative", "ngram"):
        for level, outs in outputs.get(name, {}).items():
            for a, b in zip(outs, base.get(level, []), strict=False):
                compared += 1
                identical += a == b
    return {"compared": compared, "identical": identical}


def promote(
    store: ArtifactStore,
    run_name: str,
    drafter: StageResult,
    evaluation: StageResult | None,
    report: dict[str, Any],
    markdown: str,
) -> str:
    """Copy the drafter to the stable prefix `<run>/promoted/` with the reports beside it. The
    `promotion.json` pointer is written last, so its presence means the copy is complete."""
    prefix = f"{run_name}/{PROMOTED}"
    with work_dir("aerie-promote-") as tmp:
        for key in drafter_keys(store, drafter):
            name = name_in_drafter(key)
            local = store.get_file(key, Path(tmp) / name)
            store.put_file(f"{prefix}/drafter/{name}", local)
    store.put_bytes(f"{prefix}/report.json", json.dumps(report, indent=2).encode())
    store.put_bytes(f"{prefix}/report.md", markdown.encode())
    if report.get("prediction") is not None:
        serving = with_measured(report["prediction"], report)
        store.put_bytes(f"{prefix}/serving.json", json.dumps(serving, indent=2).encode())
    if evaluation is not None:
        _copy_evaluation(store, evaluation, prefix)
    pointer = {
        "drafter": f"{drafter.prefix}/drafter",
        "evaluation": evaluation.prefix if evaluation else None,
        "speedup": report["promotion"]["speedup"],
        "concurrency": report["promotion"]["concurrency"],
    }
    # The promoted copy's card adds the served figures; before the pointer, which marks the copy complete.
    evaluated = evaluation.prefix if evaluation else None
    update_card(
        store, drafter.prefix, evaluation_prefix=evaluated, served=report, drafter_dir_key=f"{prefix}/drafter"
    )
    store.put_bytes(f"{prefix}/promotion.json", json.dumps(pointer, indent=2).encode())
    return prefix


def _copy_evaluation(store: ArtifactStore, evaluation: StageResult, prefix: str) -> None:
    """The offline evaluation's reports beside the promoted drafter."""
    for name in ("report.md", "report.json", "acceptance.png"):
        key = f"{evaluation.prefix}/{name}"
        if store.exists(key):
            store.put_bytes(f"{prefix}/evaluation-{name}", store.get_bytes(key))


def _figures(rows: list[dict[str, Any]], decision: Promotion, same: dict[str, int]) -> dict[str, Any]:
    figures: dict[str, Any] = {"promoted": decision.promoted, "speedup": decision.speedup}
    for r in rows:
        tag = {"speculative": "spec", "ngram": "ngram"}.get(r["server"], "base")
        figures[f"{tag}_tok_s_c{r['concurrency']}"] = round(r["output_tokens_per_s"], 2)
        if r["server"] == "speculative" and r.get("accept_length") is not None:
            figures[f"accept_length_c{r['concurrency']}"] = round(r["accept_length"], 3)
    figures["same_outputs"] = f"{same['identical']}/{same['compared']}"
    return figures
