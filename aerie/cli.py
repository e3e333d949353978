"""The `aerie` command's library half: presets, config inspection, evaluation and running the pipeline
in this process. The `aerie` command itself is `flows.cli`, which adds the run through Prefect; here,
without Prefect, `run` runs the stages in this process."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from aerie.bundle.cli import add_bundle_parser
from aerie.config import PipelineConfig, to_yaml
from aerie.errors import AerieError, ConfigError
from aerie.pipeline import STAGE_NAMES
from aerie.presets import PRESETS, load_config
from aerie.progress import close_terminal_bars
from aerie.settings import cache_dir_error, in_cache


def _cmd_presets(_: argparse.Namespace) -> int:
    for name, factory in PRESETS.items():
        doc = (factory.__doc__ or "").strip().splitlines()[0]
        print(f"{name:16s} {doc}")
    return 0


def _cmd_config_show(args: argparse.Namespace) -> int:
    cfg = load_config(args.preset, args.overrides)
    print(to_yaml(cfg), end="")
    print("\n".join(_drafter_shape_lines(cfg)))
    return 0


def _drafter_shape_lines(cfg: PipelineConfig) -> list[str]:
    """YAML comments: the draft layer `train.draft` resolves to for this target, where its geometry is
    on this machine (the same code the train stage and the planner resolve it with)."""
    from aerie.targets import geometry_for

    found = geometry_for(cfg.target)
    if found is None:
        return [f"# train.draft: resolved when the target {cfg.target.name} is on this machine"]
    geometry, source = found
    shape = cfg.train.draft.resolve(geometry)
    att = geometry.attention
    scaling = shape.rope.scaling or {}
    return [
        f"# target {cfg.target.name} ({source}): {geometry.num_layers} layers, hidden {geometry.hidden_size}, "
        f"{att.kind} attention of {att.num_heads} heads, vocab {geometry.vocab_size}",
        f"# train.draft resolves to: {shape.num_heads} heads, {shape.num_kv_heads} kv heads, head_dim "
        f"{shape.head_dim}, intermediate {shape.intermediate_size}, rope_theta {shape.rope.theta:g}"
        + (f", {scaling['rope_type']} x{scaling.get('factor', 1):g}" if scaling else ""),
    ]


# Runs the pipeline through an orchestrator and returns its summary (`flows.cli` passes Prefect's).
FlowRunner = Callable[[PipelineConfig], str]


def _cmd_run(args: argparse.Namespace) -> int:
    cfg = load_config(args.preset, args.overrides)
    run_flow: FlowRunner | None = args.run_flow
    if run_flow is not None and not (args.no_prefect or args.until):
        print(run_flow(cfg))
        return 0
    from aerie.pipeline import run_pipeline

    print(run_pipeline(cfg, until=args.until).table())
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from aerie.plan import check, make_plan
    from aerie.plan.render import table

    plan = make_plan(load_config(args.preset, args.overrides), args.hardware)
    print(table(plan))
    if args.json:
        Path(args.json).write_text(json.dumps(plan.record(), indent=2))
    check(plan)
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from aerie.evaluate.drafter_files import check_drafter_files, check_trained_for
    from aerie.evaluate.stage import corpus_format
    from aerie.evaluate.standalone import evaluate_drafter, prompt_set_for_file, summary_lines
    from aerie.progress import terminal_progress
    from aerie.targets import resolve_target

    cfg = load_config(args.preset, args.overrides)
    # The drafter is checked before the prompts are read and the target is resolved and loaded.
    check_drafter_files(args.drafter)
    if not args.allow_other_target:
        check_trained_for(Path(args.drafter), cfg.target.name, cfg.target.revision)
    sets = [prompt_set_for_file(path, args.limit) for path in args.prompts]
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise ConfigError(f"two prompt files have the same name {names}: rename one")
    # The drafter directory says which family's proposer measures it (`evaluate_drafter` reads it).
    evaluate_cfg = type(cfg.evaluate).model_validate(
        {
            **cfg.evaluate.model_dump(),
            "datasets": [s.model_dump() for s in sets],
            "prompt_format": corpus_format(cfg).model_dump(),  # prompts rendered as the corpus renders
        }
    )
    report = evaluate_drafter(
        evaluate_cfg,
        resolve_target(cfg.target),
        args.drafter,
        terminal_progress("evaluate"),
        allow_other_target=args.allow_other_target,
    )
    close_terminal_bars()
    print("\n".join(summary_lines(report)))
    print(report["table"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"report written to {args.json}")
    return 0


# What `aerie --help` opens with: what aerie does for its user, then where to start.
DESCRIPTION = """\
Train a speculative-decoding drafter (EAGLE-3, or DFlash) for your own target model, measure how much
faster it makes decoding, and serve it with SGLang.

A run generates the target's own answers to training conversations, builds a tokenized corpus,
extracts the target's hidden states, trains the drafter, measures its acceptance beside prompt
lookup's, and serves it against the same server without it, promoting it if it pays. Every stage
keeps its output in the store, so a run that stops resumes where it stopped.

  aerie presets                    the runs aerie ships (targets, data, hardware)
  aerie plan smollm2-local         what a run will cost (tokens, dollars, GPU time, disk) before it starts
  aerie run smollm2-local          run it (through Prefect; --no-prefect runs it in this process)
  aerie config show my-run.yaml    a run's whole config, your YAML file and key=value overrides applied
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aerie", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("presets", help="list the presets").set_defaults(func=_cmd_presets)
    config = sub.add_parser("config", help="inspect configs").add_subparsers(
        dest="config_command", required=True
    )
    show = config.add_parser("show", help="print a preset (or YAML file) with overrides applied, as YAML")
    show.add_argument("preset", help=f"a preset ({', '.join(PRESETS)}) or a YAML file")
    show.add_argument("overrides", nargs="*", help="key=value, e.g. train.epochs=2")
    show.set_defaults(func=_cmd_config_show)
    run = sub.add_parser("run", help="run the pipeline (every stage, each resuming) and print its report")
    run.add_argument("preset", help=f"a preset ({', '.join(PRESETS)}) or a YAML file")
    run.add_argument("overrides", nargs="*", help="key=value, e.g. train.epochs=2")
    run.add_argument(
        "--no-prefect", action="store_true", help="run the stages in this process without Prefect (GPU hosts)"
    )
    run.add_argument("--until", choices=STAGE_NAMES, help="stop after this stage (implies --no-prefect)")
    run.set_defaults(func=_cmd_run)
    plan = sub.add_parser(
        "plan", help="what a run will cost (tokens, dollars, GPU time, disk) before it starts"
    )
    plan.add_argument("preset", help=f"a preset ({', '.join(PRESETS)}) or a YAML file")
    plan.add_argument("overrides", nargs="*", help="key=value, e.g. train.epochs=2")
    plan.add_argument(
        "--hardware", help="h200, h100, a100, b200 or cpu (default: h200 when a stage runs on CUDA)"
    )
    plan.add_argument("--json", help="also write the plan to this file")
    plan.set_defaults(func=_cmd_plan)
    evaluate = sub.add_parser(
        "evaluate", help="measure a drafter directory's acceptance on prompt files, without a pipeline run"
    )
    evaluate.add_argument(
        "--drafter", required=True, help="a drafter directory (config.json, model.safetensors)"
    )
    evaluate.add_argument(
        "--prompts",
        action="append",
        required=True,
        help="a JSONL or Parquet file of MT-Bench questions, conversations or prompts (repeatable)",
    )
    evaluate.add_argument(
        "--preset", default="smollm2-local", help="the preset naming the target and settings"
    )
    evaluate.add_argument("--limit", type=int, default=None, help="prompts taken from each file")
    evaluate.add_argument(
        "--allow-other-target",
        action="store_true",
        help="measure a drafter whose aerie.json names another target or revision than the preset's",
    )
    evaluate.add_argument("--json", help="also write the whole report to this file")
    evaluate.add_argument("overrides", nargs="*", help="key=value, e.g. evaluate.temperatures=[0,1]")
    evaluate.set_defaults(func=_cmd_evaluate)
    add_bundle_parser(sub)
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with `key=value` overrides accepted before, between or after the options
    (argparse alone takes positionals only before the first option: `aerie run P --no-prefect k=v`)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [item for item in extra if item.startswith("-") or "=" not in item]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        if not hasattr(args, "overrides"):
            parser.error(f"{args.command} takes no key=value overrides: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: Sequence[str] | None = None, *, run_flow: FlowRunner | None = None) -> int:
    """The command line; `run_flow`, when given, runs `aerie run` (without --no-prefect or --until)."""
    args = parse_args(argv)
    args.run_flow = run_flow
    try:
        return int(args.func(args))
    except AerieError as exc:
        close_terminal_bars()
        print(f"aerie: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if not in_cache(exc.filename):
            raise
        # Any write into the cache that no module turned into its own error: the same one line.
        close_terminal_bars()
        print(f"aerie: error: {cache_dir_error(exc.filename, exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        # Ctrl-C: one line (what the stopped stage kept, how to resume), no traceback.
        close_terminal_bars()
        print(f"aerie: interrupted: {exc}" if str(exc) else "aerie: interrupted", file=sys.stderr)
        # Leaving may still wait on others' cleanup (an ephemeral Prefect API stopping): Ctrl-C again
        # ends the process at once.
        signal.signal(signal.SIGINT, lambda *_: os._exit(130))
        return 130


if __name__ == "__main__":
    sys.exit(main())
