"""DFlash against EAGLE-3 from one pipeline: the same corpus, the same token budget, the same evaluator at
the same verification width; MT-Bench and held-out acceptance length (tau, bonus token included), the
acceptance per draft position, the block size and steps, and each drafter's training seconds.

    python benchmarks/quality/dflash.py --preset smollm2-gpu                       # one H200: dflash-h200.json
    python benchmarks/quality/dflash.py --preset smollm2-local --steps 3 OVERRIDES  # the CPU smoke run

What it runs: `aerie.pipeline.run_pipeline` twice up to the evaluate stage, on the preset with the
overrides, under one run name in one store (`run=` and `store.uri=` among the overrides, else the
preset's), once with `train.drafter=eagle3` and once with `train.drafter=dflash`. The generate and merge
stages of the second run are cache hits of the first (one corpus). Extraction runs once per family over
that corpus: EAGLE-3 captures its three layers, DFlash `train.drafter.num_target_layers` (5) spread over
the target (`extract.capture_layers`); each is a cache hit when a run already made it, so a store where
`aerie run smollm2-gpu` has finished (an EAGLE-3 drafter) only adds the DFlash extraction, training and
evaluation. Both train with the preset's `train.*` (epochs, batch tokens, lr: the same tokens), and
both are measured by the evaluate stage with `evaluate.num_steps=[K]`: EAGLE-3 drafts chains of K
(`train.drafter.ttt_length=K`), DFlash blocks of K+1 tokens (`train.drafter.block_size=K+1`: the anchor and K
drafts), so each round verifies K+1 tokens either way. `--steps` is K (7, the DSpark paper's horizon).

Inputs it reads back: the stage manifests in the store (`<run>/extract/*`, `<run>/train/*/manifest.json`:
`training.wall_s`, tokens and steps; `<run>/evaluate/*/manifest.json`: `results` per prompt set, proposer,
chain length and temperature, with `conditional_acceptance` per position). Output:
`benchmarks/results/dflash-<hardware>.json` (`--out` elsewhere), with `dflash.mtbench.tau`,
`eagle3.mtbench.tau`, the same for `heldout`, per-position acceptance, block size / steps, training
seconds, and the corpus and training sizes the figures were measured at.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from aerie.config import PipelineConfig, apply_overrides
from aerie.manifest import StageResult, load_manifest
from aerie.pipeline import run_pipeline
from aerie.presets import get_preset
from aerie.store import ArtifactStore, open_store
from aerie.targets import resolve_device

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository importable
from benchmarks import records  # noqa: E402
from benchmarks.records import hardware_name  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
FAMILIES = ("eagle3", "dflash")


def family_overrides(name: str, steps: int) -> list[str]:
    """What makes a run of the other overrides train and measure `name` at `steps` drafts a round."""
    # Both stop before the deploy stage, which serves EAGLE-3 only (the config refuses DFlash with it on).
    common = [f"train.drafter={name}", f"evaluate.num_steps=[{steps}]", "deploy.enabled=false"]
    if name == "eagle3":
        return [*common, f"train.drafter.ttt_length={steps}"]
    # A 32K-token pack (smollm2-gpu) holds ~34 conversations: 512 anchors each made one 499 GiB attention on
    # an H200; 64 (~2,200 blocks a pack) trains in 67 s over 10.8M tokens and drafts as well as 32 did.
    return [*common, f"train.drafter.block_size={steps + 1}", "train.drafter.anchors_per_sequence=64"]


def config_for(preset: str, overrides: list[str], name: str, steps: int) -> PipelineConfig:
    return apply_overrides(get_preset(preset), [*overrides, *family_overrides(name, steps)])


def run_family(cfg: PipelineConfig) -> dict[str, StageResult]:
    """The pipeline up to the evaluate stage; its results by stage (generation's by dataset)."""
    return {r.stage: r for r in run_pipeline(cfg, until="evaluate").results}


def prompt_set_figures(results: list[dict[str, Any]], proposer: str, dataset: str) -> dict[str, Any]:
    """One prompt set's figures for `proposer`: tau and per-position acceptance at each temperature;
    the headline `tau` is the greedy one when measured (else the first temperature's)."""
    rows = [r for r in results if r["proposer"] == proposer and r["dataset"] == dataset]
    if not rows:
        return {}
    by_t = {
        f"T={r['temperature']:g}": {
            "tau": r["accept_length"],
            "spec_accept_length": r["spec_accept_length"],
            "conditional_acceptance": r["conditional_acceptance"],
            "draft_acceptance_rate": r["draft_acceptance_rate"],
            "prompts": r["sequences"],
            "completion_tokens": r["completion_tokens"],
        }
        for r in rows
    }
    head = next((r for r in rows if not r["temperature"]), rows[0])
    return {
        "tau": head["accept_length"],
        "temperature": head["temperature"],
        "acceptance_per_position": head["conditional_acceptance"],
        "by_temperature": by_t,
    }


def prompts(figures: dict[str, Any]) -> int:
    """How many prompts a prompt set's figures were measured on."""
    return int(next(iter(figures["by_temperature"].values()))["prompts"])


def family_record(store: ArtifactStore, name: str, stages: dict[str, StageResult]) -> dict[str, Any]:
    extract = load_manifest(store, stages["extract"].prefix)
    train = load_manifest(store, stages["train"].prefix)
    evaluation = load_manifest(store, stages["evaluate"].prefix)
    results = evaluation["results"]
    training = train["training"]
    sets = sorted({r["dataset"] for r in results})
    return {
        **{s: prompt_set_figures(results, name, s) for s in sets},
        "prompt_lookup": {s: prompt_set_figures(results, "prompt_lookup", s).get("tau") for s in sets},
        "capture_layers": extract["layers"]["output_of_layer"],
        "extract_tokens": extract["figures"]["tokens"],
        "training_seconds": training.get("wall_s"),
        "train_tokens": training.get("tokens"),
        "train_steps": training.get("total_steps"),
        "trainer_accept_length_rounds": train["figures"].get("accept_length_rounds"),
        "outputs_identical": evaluation["figures"].get("outputs_identical"),
        "stages": {stage: stages[stage].prefix for stage in ("extract", "train", "evaluate")},
        # Each stage's time when it ran (a cache hit of an earlier invocation reports that run's).
        "stage_seconds": {
            stage: round(r.original_seconds if r.cache_hit and r.original_seconds else r.seconds, 1)
            for stage, r in stages.items()
        },
    }


def record(
    args: argparse.Namespace,
    configs: dict[str, PipelineConfig],
    runs: dict[str, Any],
    seconds: dict[str, float],
) -> dict[str, Any]:
    eagle, dflash = runs["eagle3"], runs["dflash"]
    cfg = configs["dflash"]
    k = args.steps
    comparison = {
        s: {"dflash_minus_eagle3": round(dflash[s]["tau"] - eagle[s]["tau"], 4)}
        for s in ("mtbench", "heldout")
        if dflash.get(s) and eagle.get(s)
    }
    return {
        "benchmark": "dflash",
        "date": records.now(),
        "machine": {"host": platform.node(), "python": platform.python_version(), "device": args.device},
        "command": records.command(),
        "preset": args.preset,
        "run": cfg.run,
        "store": cfg.store.uri,
        "steps": k,
        "block_size": k + 1,
        "ttt_length": k,
        "verification_width": k + 1,
        "note": args.note,
        "size": {
            "corpus_samples": sum(d.num_samples for d in cfg.generate.datasets),
            "eval_prompts": {s: prompts(eagle[s]) for s in ("mtbench", "heldout") if eagle.get(s)},
            "max_new_tokens": cfg.evaluate.max_new_tokens,
            "train_epochs": cfg.train.epochs,
            "train_tokens": {n: runs[n]["train_tokens"] for n in FAMILIES},
        },
        "eagle3": eagle,
        "dflash": dflash,
        "comparison": comparison,
        "goal_dflash_tau_at_least_eagle3_on_mtbench": (
            dflash["mtbench"]["tau"] >= eagle["mtbench"]["tau"] if "mtbench" in comparison else None
        ),
        "this_invocation_seconds": {n: round(seconds[n], 1) for n in FAMILIES},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--preset", default="smollm2-gpu", help="the pipeline preset both runs start from")
    parser.add_argument("--steps", type=int, default=7, help="drafts per round (K): verification width K+1")
    parser.add_argument("--out", type=Path, default=None, help="default: results/dflash-<hardware>.json")
    parser.add_argument("--note", default="", help="what the run's size makes of its figures (recorded)")
    parser.add_argument(
        "overrides", nargs="*", help="key=value overrides for both runs (run=, store.uri=, ...)"
    )
    args = parser.parse_args()
    configs = {n: config_for(args.preset, args.overrides, n, args.steps) for n in FAMILIES}
    args.device = resolve_device(configs["dflash"].evaluate.device)
    store = open_store(configs["dflash"].store)
    runs: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for name in FAMILIES:
        began = time.monotonic()
        stages = run_family(configs[name])
        seconds[name] = time.monotonic() - began
        runs[name] = family_record(store, name, stages)
    out = args.out or RESULTS / f"dflash-{hardware_name(args.device)}.json"
    body = record(args, configs, runs, seconds)
    out.write_text(json.dumps(body, indent=2) + "\n")
    print(
        json.dumps({n: {s: body[n].get(s, {}).get("tau") for s in ("mtbench", "heldout")} for n in FAMILIES})
    )
    print(f"written to {out}")


if __name__ == "__main__":
    main()
