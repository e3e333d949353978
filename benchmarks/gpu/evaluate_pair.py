"""Several drafters of one pipeline run through aerie's evaluator, in one process: the target loaded
once, every drafter decoding the same prompts (MT-Bench and the run's held-out split) with the same
settings (the run's `evaluate` section, greedy, EAGLE-3 proposer), lossless, so every drafter's outputs
must equal every other's token for token; that agreement is counted.

    python benchmarks/gpu/evaluate_pair.py --config HOME/configs/RUN.yaml \\
        --drafter aerie=DIR --drafter specforge=DIR --out pair.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from aerie.config import load_yaml
from aerie.errors import DataError
from aerie.evaluate.config import EvaluateConfig
from aerie.evaluate.prompts import ALL_ROWS, EvalPrompt, heldout_prompts, prompt_set
from aerie.evaluate.work import load_drafter_of, measure_setting
from aerie.families import family
from aerie.manifest import StageDir, StageResult
from aerie.store import ArtifactStore, open_store
from aerie.targets import TargetInfo, resolve_device, resolve_dtype, resolve_target


def corpus_result(store: ArtifactStore, root: Path, run: str) -> StageResult:
    """The run's one finished merge stage (the corpus whose eval split is the held-out set)."""
    keys = sorted(p.parent.name for p in (root / run / "merge").glob("*/manifest.json"))
    if len(keys) != 1:
        raise DataError(f"{root / run / 'merge'}: expected one finished merge stage, found {len(keys)}")
    result = StageDir(store, run, "merge", keys[0]).cached_result()
    assert result is not None  # the manifest was just found
    return result


def prompt_sets(
    cfg: EvaluateConfig, store: ArtifactStore, corpus: StageResult, target: TargetInfo
) -> dict[str, list[EvalPrompt]]:
    """The prompts by set, as the evaluate stage builds them."""
    tokenizer = target.load_tokenizer()
    sets: dict[str, list[EvalPrompt]] = {}
    for spec in cfg.prompt_sets():
        if spec.kind == "heldout":
            held, _ = heldout_prompts(store, corpus, spec.limit or ALL_ROWS, cfg.max_prompt_tokens, spec.name)
            if held:
                sets[spec.name] = held
        else:
            sets[spec.name] = prompt_set(tokenizer, spec, cfg.max_prompt_tokens)
    return sets


def agreement(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Prompts whose output is the same in every (drafter, chain length) that decoded it."""
    outputs: dict[tuple[str, str], set[str]] = defaultdict(set)
    for row in rows:
        outputs[(row["dataset"], row["id"])].add(row["output_sha"])
    return {"prompts": len(outputs), "identical": sum(len(v) == 1 for v in outputs.values())}


def evaluate(config: Path, drafters: dict[str, Path]) -> dict[str, Any]:
    pipeline = load_yaml(config)
    cfg = pipeline.evaluate.model_copy(update={"proposers": ["eagle3"], "temperatures": [0.0]})
    store = open_store(pipeline.store)
    target = resolve_target(pipeline.target)
    sets = prompt_sets(cfg, store, corpus_result(store, Path(pipeline.store.uri), pipeline.run), target)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    started = time.perf_counter()
    model = target.load_model(device, str(dtype).removeprefix("torch."))
    out: dict[str, Any] = {"drafters": {}}
    rows: list[dict[str, Any]] = []
    for name, path in drafters.items():
        loaded = {"model": model, **load_drafter_of(family("eagle3"), target, path, device, dtype)}
        results = []
        for dataset, prompts in sets.items():
            for k in cfg.num_steps:
                part = measure_setting(
                    cfg, loaded, target, dataset, prompts, "eagle3", (k, 0.0), lambda _: None
                )
                results.append(part["result"])
                rows += [{**r, "drafter": name} for r in part["per_prompt"]]
                print(f"{name:>10s} {dataset:>8s} k={k}  τ={part['result']['accept_length']:.3f}", flush=True)
        out["drafters"][name] = {"dir": str(path), "results": results}
    out.update(
        target={"name": target.name, "revision": target.revision},
        config=cfg.model_dump(mode="json"),
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        prompts={name: len(p) for name, p in sets.items()},
        agreement=agreement(rows),
        seconds=round(time.perf_counter() - started, 1),
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--config", required=True, type=Path, help="the run's config (YAML)")
    parser.add_argument("--drafter", action="append", required=True, help="NAME=DIR, once per drafter")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    drafters = {}
    for item in args.drafter:
        name, sep, path = item.partition("=")
        if not sep or not name or not Path(path, "config.json").is_file():
            raise SystemExit(f"--drafter {item!r}: expected NAME=DIR with DIR/config.json")
        drafters[name] = Path(path)
    report = evaluate(args.config, drafters)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"agreement": report["agreement"], "seconds": report["seconds"]}))


if __name__ == "__main__":
    main()
