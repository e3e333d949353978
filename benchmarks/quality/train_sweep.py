"""Training settings compared on one extraction: each variant trains a drafter and evaluates it.

    # on the GPU host, with a finished run restored into the home (docs/gpu-host.md):
    eval "$(python3 -m tools.gpuhost env)"
    python3 benchmarks/quality/train_sweep.py smollm2-gpu --store "$HOME_DIR/store" \
        --variant base --variant data50 train.train_fraction=0.5 --variant epochs6 train.epochs=6 \
        --common 'evaluate.proposers=[eagle3]' 'evaluate.num_steps=[7]' evaluate.heldout_samples=0
    # here, a smoke run on the embedded default (CPU):
    .venv/bin/python benchmarks/quality/train_sweep.py smollm2-local --variant base \
        --variant data50 train.train_fraction=0.5

A variant is a name and its overrides; each runs as the preset with `--common` and then its own
overrides applied, through the evaluate stage (`aerie.pipeline.run_pipeline`), or only through the
train stage with `--until train` (the trainer's held-out acceptance is then the figure). An override
`recipe=NAME` stands for a named recipe's settings (`aerie.train.recipes`: eagle3_converged,
dflash_authors), so `--variant dflash_authors recipe=dflash_authors train.epochs=2` is that recipe
at two epochs; `--final` overrides come after every variant's (a sweep's data size and epochs over the
recipes' own). Each family's variants share its extraction (EAGLE-3 and DFlash capture different
layers: one extraction per family). `--budget-s` leaves the variants that would start with less than
`--reserve-s` of it left unrun (recorded as skipped), so a sweep inside a time limit still writes its
record; list the variants in the order they matter. Generation, merge and
extraction are cache hits shared by every variant (the extraction is re-made once if its shards are
gone), so only training and evaluation run; a variant that finished before is a hit as well, so a sweep
stopped at a time limit (SIGTERM unwinds the stages as `tools.gpuhost` does) resumes where it stopped.

Nothing is timed here: every figure is read from the manifests the stages wrote. Per variant: its
resolved training settings, the training tokens, steps and wall time, the held-out acceptance of the
step the trainer kept (chosen by that acceptance, walked in rounds) with its per-position acceptance,
the held-out curve (acceptance against training tokens), and with the evaluate stage its acceptance
length and conditional acceptance per dataset, proposer and draft depth. `winners`: per drafter family,
the variant whose kept step accepted the most held out. Writes
benchmarks/results/train_sweep-<device>.json after each variant and prints a table at the end.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from aerie.manifest import StageResult, load_manifest
from aerie.pipeline import run_pipeline
from aerie.presets import load_config
from aerie.store import ArtifactStore, open_store
from aerie.train.recipes import recipe
from aerie.train.work import METRICS

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository importable
from benchmarks.records import hardware_name  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", help="preset name or YAML file")
    ap.add_argument(
        "--variant", nargs="+", action="append", required=True, metavar=("NAME", "OVERRIDE"),
        help="a variant: its name, then its key=value overrides (none: the preset as it is)",
    )  # fmt: skip
    ap.add_argument("--common", nargs="*", default=[], help="overrides applied to every variant first")
    ap.add_argument(
        "--final", nargs="*", default=[],
        help="overrides applied to every variant last: the sweep's data size over a recipe's epochs",
    )  # fmt: skip
    ap.add_argument("--until", choices=("train", "evaluate"), default="evaluate", help="the last stage run")
    ap.add_argument("--budget-s", type=float, help="seconds for the whole sweep (default: no limit)")
    ap.add_argument("--reserve-s", type=float, default=60.0, help="start no variant with less left")
    ap.add_argument("--store", help="the store (store.uri): the GPU host's is HOME/store")
    ap.add_argument("--out", help="default benchmarks/results/train_sweep-<device>.json")
    args = ap.parse_args(argv)
    names = [v[0] for v in args.variant]
    if len(set(names)) != len(names):
        ap.error(f"variant names repeat: {names}")
    if bad := [o for v in args.variant for o in v[1:] if "=" not in o]:
        ap.error(f"overrides are key=value: {bad}")
    return args


def expand(overrides: list[str]) -> list[str]:
    """`recipe=NAME` replaced by that recipe's settings; other overrides as they are, in order."""
    out: list[str] = []
    for o in overrides:
        key, _, value = o.partition("=")
        out.extend(recipe(value).overrides if key == "recipe" else [o])
    return out


def stage_of(results: list[StageResult], stage: str) -> StageResult:
    found = [r for r in results if r.stage == stage]
    if not found:
        raise SystemExit(f"the pipeline returned no {stage} result")
    return found[-1]


def curve(store: ArtifactStore, train: StageResult) -> list[dict[str, Any]]:
    """The trainer's held-out evaluations: step, training tokens seen by then, acceptance in rounds."""
    rows = [json.loads(line) for line in store.get_bytes(f"{train.prefix}/{METRICS}").splitlines() if line]
    tokens_at = {r["step"]: r["tokens"] for r in rows if r.get("kind") == "train"}
    out = []
    for r in rows:
        if r.get("kind") != "eval":
            continue
        seen = max((s for s in tokens_at if s <= r["step"]), default=None)
        out.append(
            {
                "step": r["step"],
                "tokens": tokens_at[seen] if seen is not None else None,
                "accept_length_rounds": r["accept_length_rounds"],
            }
        )
    return out


def kept_step(store: ArtifactStore, train: StageResult, best_step: int) -> dict[str, Any]:
    """The held-out evaluation of the step the trainer kept: acceptance in rounds and per position."""
    rows = [json.loads(line) for line in store.get_bytes(f"{train.prefix}/{METRICS}").splitlines() if line]
    found = [r for r in rows if r.get("kind") == "eval" and r["step"] == best_step]
    if not found:
        return {}
    r = found[-1]
    keep = ("accept_length_rounds", "accept_length", "acc", "cond_acc", "loss", "rounds")
    return {"step": best_step, **{k: r.get(k) for k in keep}}


def train_only_record(
    store: ArtifactStore, name: str, overrides: list[str], settings: dict[str, Any], report: Any
) -> dict[str, Any]:
    train, extract = stage_of(report.results, "train"), stage_of(report.results, "extract")
    tm = load_manifest(store, train.prefix)
    figures = tm["figures"]
    return {
        "name": name,
        "overrides": overrides,
        "family": tm.get("family"),
        "settings": settings,
        "extract": {"key": extract.key, "cache_hit": extract.cache_hit},
        "train": {
            "key": train.key,
            "cache_hit": train.cache_hit,
            "wall_s": figures.get("train_wall_s"),
            "stage_s": tm.get("seconds"),
            "figures": figures,
            "heldout": kept_step(store, train, figures["best_step"]),
            "curve": curve(store, train),
        },
    }


def winners(variants: list[dict[str, Any]]) -> dict[str, Any]:
    """Per family, the variant whose kept step accepted the most held out (walked in rounds)."""
    best: dict[str, Any] = {}
    for v in variants:
        if "error" in v or "skipped" in v:
            continue
        family, figure = v.get("family") or "eagle3", v["train"]["figures"]["accept_length_rounds"]
        if family not in best or figure > best[family]["accept_length_rounds"]:
            best[family] = {"variant": v["name"], "accept_length_rounds": figure}
    return best


def variant_record(store: ArtifactStore, name: str, overrides: list[str], report: Any) -> dict[str, Any]:
    train, evaluation = stage_of(report.results, "train"), stage_of(report.results, "evaluate")
    tm, em = load_manifest(store, train.prefix), load_manifest(store, evaluation.prefix)
    keep = (
        "dataset",
        "proposer",
        "num_steps",
        "accept_length",
        "conditional_acceptance",
        "draft_vocab_coverage",
    )
    return {
        "name": name,
        "overrides": overrides,
        "train": {
            "key": train.key,
            "cache_hit": train.cache_hit,
            "wall_s": tm.get("seconds"),
            "figures": tm["figures"],
            "curve": curve(store, train),
        },
        "evaluate": {
            "key": evaluation.key,
            "cache_hit": evaluation.cache_hit,
            "wall_s": em.get("seconds"),
            "results": [{k: r.get(k) for k in keep} for r in em["results"]],
        },
    }


def table(variants: list[dict[str, Any]]) -> str:
    """One line per variant: training figures, then acceptance length per evaluated (dataset, proposer, k)."""
    columns = sorted(
        {
            (r["dataset"], r["proposer"], r["num_steps"])
            for v in variants
            for r in v.get("evaluate", {}).get("results", [])
        }
    )
    head = ["variant", "train tokens", "steps", "train s", "held-out rounds"]
    head += [f"{d} {p} k{k}" for d, p, k in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in variants:
        f = v["train"]["figures"]
        got = {
            (r["dataset"], r["proposer"], r["num_steps"]): r["accept_length"]
            for r in v.get("evaluate", {}).get("results", [])
        }
        cells = [v["name"], f"{f['train_tokens']:,}", str(f["steps"]), f"{v['train']['wall_s']:.0f}"]
        cells += [f"{f['accept_length_rounds']:.2f}"] + [
            f"{got[c]:.2f}" if c in got else "–" for c in columns
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine() -> str:
    import torch

    text = f"{platform.node()} {platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}"
    return text + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU")


def main(argv: list[str] | None = None) -> None:
    import torch

    args = parse_args(argv)
    began = time.monotonic()
    # A time limit's SIGTERM unwinds the stages (servers stop, checkpoints stay) like any error.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out or RESULTS / f"train_sweep-{hardware_name(device)}.json")
    record: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "card": hardware_name(device),
        "until": args.until,
        "command": " ".join(
            ["python", "benchmarks/quality/train_sweep.py", *sys.argv[1:]] if argv is None else argv
        ),
        "complete": False,
        "preset": args.preset,
        "common": args.common,
        "final": args.final,
        "variants": [],
        "winners": {},
    }
    store_override = [f"store.uri={args.store}"] if args.store else []
    # Every variant's config first: a typo in the last one must not surface after an hour of the others.
    configs = [
        load_config(args.preset, [*args.common, *expand(overrides), *args.final, *store_override])
        for _, *overrides in args.variant
    ]
    for (name, *overrides), cfg in zip(args.variant, configs, strict=True):
        left = None if args.budget_s is None else args.budget_s - (time.monotonic() - began)
        if left is not None and left < args.reserve_s:
            print(f"train_sweep: variant {name} not started: {left:.0f} s of the budget left", flush=True)
            record["variants"].append({"name": name, "overrides": overrides, "skipped": f"{left:.0f} s left"})
            continue
        store = open_store(cfg.store)
        print(f"train_sweep: variant {name} ({' '.join(overrides) or 'the preset'})", flush=True)
        try:
            report = run_pipeline(cfg, until=args.until, store=store)
        except Exception as exc:  # e.g. out of GPU memory: recorded, and the other variants still run
            print(f"train_sweep: variant {name} failed: {exc}", flush=True)
            record["variants"].append(
                {"name": name, "overrides": overrides, "error": f"{type(exc).__name__}: {exc}"}
            )
        else:
            settings = cfg.train.model_dump(mode="json")
            if args.until == "train":
                record["variants"].append(train_only_record(store, name, overrides, settings, report))
            else:
                entry = variant_record(store, name, overrides, report)
                entry["family"], entry["settings"] = cfg.train.drafter.family, settings
                train = stage_of(report.results, "train")
                best = entry["train"]["figures"]["best_step"]
                entry["train"]["heldout"] = kept_step(store, train, best)
                record["variants"].append(entry)
        record["winners"] = winners(record["variants"])
        out.write_text(json.dumps(record, indent=1) + "\n")
    record["complete"] = True
    record["sweep_s"] = round(time.monotonic() - began, 1)
    out.write_text(json.dumps(record, indent=1) + "\n")
    done = [v for v in record["variants"] if "error" not in v and "skipped" not in v]
    failed = [
        f"{v['name']}: " + (v["error"] if "error" in v else f"skipped, {v['skipped']}")
        for v in record["variants"]
        if "error" in v or "skipped" in v
    ]
    print("\n".join([f"wrote {out}", table(done), json.dumps(record["winners"]), *failed]))


if __name__ == "__main__":
    main()
