"""Where a trained drafter's acceptance is lost, on this machine (CPU is enough for SmolLM2).

    .venv/bin/python benchmarks/quality/diagnose.py --drafter DIR [--mtbench 8] [--max-new-tokens 128]
        [--corpus-eval EVAL.parquet --corpus-rows 80]

- MT-Bench: the target decodes each question with the drafter (lossless speculative decoding, as the
  evaluate stage does) and the measured acceptance length is set beside the one simulated from the
  drafter's training-time-test forward on the same answers (`aerie.evaluate.diagnose`): equal figures
  mean serving drafts what training taught; fp8-roundtripped features (as the shards store them) are
  simulated too.
- corpus eval split (optional): the same teacher-forced replay on the corpus's own answers (the target's
  generations the drafter was trained on), for step-0 accuracy by position in the whole answer.

With `--answers` (an evaluate stage's `parts/mtbench-eagle3-k<N>.json`, which keeps the decoded
answers) nothing is decoded: the answers the GPU measured are replayed, with that part's measured
figures beside the simulated ones. With `--token-counts` (the merge stage's token_counts.parquet) the
answers' coverage by draft vocabs of other sizes is added. Every run also reports the acceptance length
by MT-Bench category and the vocabulary bound (the simulated figure had every answer token outside the
draft vocabulary been drafted right).

The drafter of the `smollm2-gpu` run on an H200 comes back with `python -m tools.gpuhost restore --home /tmp/h
.stage/state` (store/<run>/train/<key>/drafter, the evaluate stage's parts and the merge stage's eval
parquet and token counts beside it). Writes benchmarks/results/diagnose-cpu.json (or `--out`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from aerie.draft.export import load_drafter
from aerie.draft.vocab import counts_from_frame, coverage_by_size
from aerie.engine.speculative.decoder import SpecDecoder, SpecStats
from aerie.engine.speculative.eagle import EagleProposer
from aerie.evaluate.diagnose import diagnose
from aerie.evaluate.prompts import EvalPrompt, mtbench_prompts
from aerie.evaluate.report import acceptance_by_group
from aerie.fp8 import dequantize_fp8, quantize_fp8
from aerie.targets import resolve_target

RESULTS = Path(__file__).resolve().parents[1] / "results"


class Fp8Features(torch.nn.Module):
    """The target, with its hidden states passed through the shards' fp8 quantization (per token,
    per layer scales), as the trainer read them."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, output_hidden_states: bool = True) -> Any:
        out = self.model(ids, output_hidden_states=True)
        out.hidden_states = tuple(
            dequantize_fp8(*quantize_fp8(h[0], 1), torch.float32)[None] for h in out.hidden_states
        )
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", required=True, help="an exported drafter directory")
    p.add_argument("--mtbench", type=int, default=8, help="MT-Bench questions decoded")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--answers", default=None, help="an evaluate part mtbench-eagle3-k<N>.json: no decoding")
    p.add_argument("--token-counts", default=None, help="the merge stage's token_counts.parquet")
    p.add_argument("--no-fp8", dest="fp8", action="store_false", help="skip the fp8-features replay")
    p.add_argument("--corpus-eval", default=None, help="the merge stage's eval-*.parquet")
    p.add_argument("--corpus-rows", type=int, default=80)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "diagnose-cpu.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    target = resolve_target("smollm2-135m-instruct")
    model = target.load_model("cpu", "float32")
    drafter = load_drafter(args.drafter, target, device="cpu", dtype=torch.float32)
    if args.answers:
        prompts, answers, mtbench = stored_answers(target, args)
    else:
        prompts, answers, mtbench = decoded_answers(target, model, drafter, args)
    pairs = [(q.input_ids, answers[q.id]) for q in prompts]
    mtbench["teacher_forced"] = diagnose(model, drafter, pairs, args.steps, args.max_new_tokens)
    if args.fp8:
        mtbench["teacher_forced_fp8_features"] = diagnose(
            Fp8Features(model), drafter, pairs, args.steps, args.max_new_tokens
        )
    if args.token_counts:
        mtbench["vocab_coverage_by_size"] = vocab_what_if(args.token_counts, target, drafter, answers)
    figures: dict[str, Any] = {"mtbench": mtbench}
    print(json.dumps(figures["mtbench"], indent=1), flush=True)
    if args.corpus_eval:
        figures["corpus_eval"] = corpus_figures(model, drafter, args)
        print(json.dumps(figures["corpus_eval"], indent=1), flush=True)
    weights = Path(args.drafter) / "model.safetensors"
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}, {args.threads} threads",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "drafter_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        "figures": figures,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def decoded_answers(
    target: Any, model: Any, drafter: Any, args: argparse.Namespace
) -> tuple[list[EvalPrompt], dict[str, list[int]], dict[str, Any]]:
    """The first MT-Bench questions decoded here with the drafter (lossless speculative decoding)."""
    proposer = EagleProposer(drafter)
    prompts = mtbench_prompts(target.load_tokenizer(), args.mtbench, 1024)
    decoder = SpecDecoder(
        model,
        proposer,
        num_steps=args.steps,
        eos_token_ids=target.eos_token_ids,
        aux_layers=proposer.aux_layers,
    )
    outputs = decoder.generate([q.input_ids for q in prompts], args.max_new_tokens)
    stats = SpecStats(args.steps)
    for out in outputs:
        stats.add(out)
    rows = [
        {"dataset": "mtbench", "group": q.group, "proposer": "eagle3", "num_steps": args.steps,
         "completion_tokens": out.completion_tokens, "spec_verify_ct": out.verify_ct}
        for q, out in zip(prompts, outputs, strict=True)
    ]  # fmt: skip
    figures = {
        "prompts": len(prompts),
        "measured_accept_length": round(stats.accept_length, 4),
        "measured_conditional_acceptance": [
            None if c is None else round(c, 4) for c in stats.conditional_acceptance
        ],
        "by_category": acceptance_by_group(rows),
    }
    return prompts, {q.id: out.output_ids for q, out in zip(prompts, outputs, strict=True)}, figures


def stored_answers(
    target: Any, args: argparse.Namespace
) -> tuple[list[EvalPrompt], dict[str, list[int]], dict[str, Any]]:
    """An evaluate part's answers and measured figures; its prompts rebuilt as the evaluate stage built
    them (`max_prompt_tokens` 1024, the default), each checked against the part's prompt length."""
    part = json.loads(Path(args.answers).read_text())
    result, answers = part["result"], part["answers"]
    if result["num_steps"] != args.steps:
        raise SystemExit(
            f"{args.answers} was decoded with {result['num_steps']} steps, --steps is {args.steps}"
        )
    by_id = {q.id: q for q in mtbench_prompts(target.load_tokenizer(), None, 1024)}
    rows = part["per_prompt"]
    for r in rows:
        if len(by_id[r["id"]].input_ids) != r["prompt_tokens"]:
            raise SystemExit(
                f"{r['id']}: the prompt is {len(by_id[r['id']].input_ids)} tokens here, {r['prompt_tokens']} in the part"
            )
        r["group"] = by_id[r["id"]].group
    figures = {
        "prompts": len(rows),
        "answers_from": args.answers,
        "measured_accept_length": result["accept_length"],
        "measured_conditional_acceptance": result["conditional_acceptance"],
        "by_category": acceptance_by_group(rows),
    }
    return [by_id[r["id"]] for r in rows], answers, figures


def vocab_what_if(path: str, target: Any, drafter: Any, answers: dict[str, list[int]]) -> dict[str, float]:
    import polars as pl

    counts = counts_from_frame(pl.read_parquet(path), target.geometry.vocab_size, path)
    ids = torch.tensor([t for answer in answers.values() for t in answer], dtype=torch.int64)
    found = coverage_by_size(counts, ids, int(drafter.d2t.numel()), sizes=(8192, 24576, 32768))
    return {str(k): round(v, 4) for k, v in found.items()}


def corpus_figures(model: Any, drafter: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The replay on the corpus's own answers (each row cut at its first supervised token)."""
    import polars as pl

    pairs = []
    for row in pl.read_parquet(args.corpus_eval).head(args.corpus_rows).iter_rows(named=True):
        mask = list(row["loss_mask"])
        if 1 in mask and mask.index(1) > 0:
            first = mask.index(1)
            pairs.append((list(row["input_ids"][:first]), list(row["input_ids"][first:])))
    longest = max(len(a) for _, a in pairs)
    return {"rows": len(pairs), **diagnose(model, drafter, pairs, args.steps, longest + 1)}


if __name__ == "__main__":
    main()
