"""Online training against offline (extract to shards, then train) on one small corpus, on the CPU.

The embedded target (SmolLM2-135M-Instruct) served by the reference server, a corpus of its tokenizer's
ids, the embedded default's training settings cut to two epochs. Each phase runs in its own process, so
its peak RSS is that trainer's (or extractor's) alone; the servers are processes of their own and not
counted. Figures: wall time of each stage call, tokens trained per second, online over offline (against
the training alone and against extract + train), the trainer's peak RSS, bytes each phase added to the
store, and the final loss (the same in both: the same values in the same order).

    .venv/bin/python benchmarks/stages/online.py        # writes benchmarks/results/online-cpu.json
    .venv/bin/python benchmarks/stages/online.py --train-rows 48 --buffer-tokens 2048
                                                  # a corpus several times the buffer: online extracts
                                                  # again every epoch, as a large corpus does

A corpus that fits the buffer is extracted once for every epoch; one larger than it is extracted again
each epoch, which is what `aerie plan` prices online training at. The record keeps the figures it replaces
under `earlier` when they were measured in the other regime, so the two can be compared.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RESULT = ROOT / "benchmarks" / "results" / "online-cpu.json"
RUN = "bench"
TRAIN_ROWS, EVAL_ROWS = 24, 4
BUFFER_TOKENS = 65536  # train.online.buffer_tokens' default
# The embedded default's training, two epochs, one evaluation at the end, no checkpoint before it.
TRAIN = ["train.epochs=2", "train.eval_every=1000", "train.checkpoint_every=1000", "train.log_every=1"]


def _config(work: Path, port: int, buffer_tokens: int = BUFFER_TOKENS) -> Any:
    from aerie.pipeline import resolve
    from aerie.presets import load_config
    from aerie.targets import resolve_target

    overrides = [f"store.uri={work / 'store'}", f"run={RUN}", f"server.port={port}", *TRAIN]
    overrides.append(f"train.online.buffer_tokens={buffer_tokens}")
    overrides += [f"extract.work_dir={work / 'extract'}", f"train.cache_dir={work / 'train-cache'}"]
    cfg = load_config("smollm2-local", overrides)
    target = resolve_target(cfg.target)
    return resolve(cfg, target, None), target


def _prepare(work: Path, train_rows: int) -> dict[str, Any]:
    """The corpus in the store, as the merge stage leaves it (rows and token counts)."""

    from aerie.store import LocalStore
    from tests.extract_support import corpus_rows, write_corpus
    from tests.online_support import put_token_counts

    _, target = _config(work, 30000)  # no server here: any port
    rows = corpus_rows(target.load_tokenizer(), train_rows + EVAL_ROWS, seed=7, min_words=60, max_words=200)
    store = LocalStore(work / "store")
    corpus = write_corpus(store, RUN, {"train": rows[:train_rows], "eval": rows[train_rows:]})
    put_token_counts(store, corpus, rows[:train_rows], target.geometry.vocab_size, work)
    (work / "corpus.json").write_text(corpus.model_dump_json())
    return {"rows": len(rows), "tokens": sum(len(r["input_ids"]) for r in rows)}


def _phase(name: str, work: Path, port: int, buffer_tokens: int) -> dict[str, Any]:
    """One phase in this process: the stage call's wall time, its figures, this process's peak RSS."""
    from aerie.extract import work as extract_work
    from aerie.manifest import StageResult
    from aerie.store import LocalStore
    from aerie.train import work as train_work
    from tests.stage_work import staged

    extract, train = staged("extract", extract_work.run), staged("train", train_work.run)

    cfg, target = _config(work, port, buffer_tokens)
    store = LocalStore(work / "store")
    corpus = StageResult.model_validate_json((work / "corpus.json").read_text())
    began = time.perf_counter()
    if name == "extract":
        result = extract(
            cfg.extract, store=store, run_name=RUN, target=target, corpus=corpus, server=cfg.server
        )
        (work / "shards.json").write_text(result.model_dump_json())
    elif name == "offline":
        shards = StageResult.model_validate_json((work / "shards.json").read_text())
        result = train(cfg.train, store=store, run_name=RUN, target=target, shards=shards, corpus=corpus)
    else:
        online = cfg.train.model_copy(update={"source": "online"})
        result = train(
            online, store=store, run_name=RUN, target=target, shards=None, corpus=corpus,
            extract=cfg.extract, server=cfg.server,
        )  # fmt: skip
    wall = time.perf_counter() - began
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"wall_s": wall, "peak_rss_bytes": peak_kib * 1024, "figures": result.figures}


def _store_bytes(work: Path) -> int:
    return sum(p.stat().st_size for p in (work / "store").rglob("*") if p.is_file())


def _run_phase(name: str, work: Path, port: int, buffer_tokens: int) -> dict[str, Any]:
    before = _store_bytes(work)
    argv = ["--phase", name, "--work", str(work), "--port", str(port), "--buffer-tokens", str(buffer_tokens)]
    out = subprocess.run(
        [sys.executable, __file__, *argv],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    measured["store_bytes_written"] = _store_bytes(work) - before
    return measured


def main(train_rows: int, buffer_tokens: int) -> None:
    import torch

    from tests.processes import free_port

    with tempfile.TemporaryDirectory(prefix="aerie-online-bench-") as tmp:
        work = Path(tmp)
        corpus = _prepare(work, train_rows)
        port = free_port()
        extracted = _run_phase("extract", work, port, buffer_tokens)
        offline = _run_phase("offline", work, port, buffer_tokens)
        online = _run_phase("online", work, port, buffer_tokens)
    tokens = offline["figures"]["train_tokens"]
    assert online["figures"]["train_tokens"] == tokens
    offline_total = extracted["wall_s"] + offline["wall_s"]
    figures = {
        "target": "smollm2-135m-instruct",
        "corpus": {**corpus, "train_rows": train_rows, "eval_rows": EVAL_ROWS},
        "buffer_tokens": buffer_tokens,
        "corpus_over_buffer": round(corpus["tokens"] / buffer_tokens, 2),
        "train_overrides": TRAIN,
        "tokens_trained": tokens,
        "offline": {
            "extract_s": round(extracted["wall_s"], 1),
            "train_s": round(offline["wall_s"], 1),
            "total_s": round(offline_total, 1),
            "train_tokens_per_s": round(tokens / offline["wall_s"], 1),
            "total_tokens_per_s": round(tokens / offline_total, 1),
            "trainer_peak_rss_bytes": offline["peak_rss_bytes"],
            "extractor_peak_rss_bytes": extracted["peak_rss_bytes"],
            "store_bytes_written": extracted["store_bytes_written"] + offline["store_bytes_written"],
            "shard_bytes": extracted["figures"].get("bytes"),
            "final_loss": offline["figures"]["final_loss"],
        },
        "online": {
            "train_s": round(online["wall_s"], 1),
            "train_tokens_per_s": round(tokens / online["wall_s"], 1),
            "trainer_peak_rss_bytes": online["peak_rss_bytes"],
            "store_bytes_written": online["store_bytes_written"],
            "extracted_tokens": online["figures"]["extracted_tokens"],
            "final_loss": online["figures"]["final_loss"],
        },
        # Tokens/s online over offline: against offline's training alone, and against extract + train.
        "ratio_online_over_offline_train": round(offline["wall_s"] / online["wall_s"], 3),
        "ratio_online_over_offline_total": round(offline_total / online["wall_s"], 3),
        "same_final_loss": online["figures"]["final_loss"] == offline["figures"]["final_loss"],
    }
    record: dict[str, Any] = {
        "code_paths": ["benchmarks/stages/online.py", "aerie/train", "aerie/extract", "aerie/engine/server"],
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "device": "cpu",
            "load_average_1m": round(os.getloadavg()[0], 2),
        },
        "command": f"python benchmarks/stages/online.py --train-rows {train_rows} --buffer-tokens {buffer_tokens}",
        "figures": figures,
    }
    earlier = _other_regime(figures)
    if earlier:
        record["earlier"] = earlier
    RESULT.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(figures, indent=2))


def _fits(figures: dict[str, Any]) -> bool:
    return bool(figures["corpus"]["tokens"] <= figures.get("buffer_tokens", BUFFER_TOKENS))


def _other_regime(figures: dict[str, Any]) -> dict[str, Any] | None:
    """The record's figures this run replaces, where their corpus sat on the other side of the buffer."""
    if not RESULT.is_file():
        return None
    old = json.loads(RESULT.read_text())
    if "figures" not in old or _fits(old["figures"]) == _fits(figures):
        return old.get("earlier")  # type: ignore[no-any-return]
    said = (
        "fit the buffer: extracted once for every epoch" if _fits(old["figures"]) else "exceeded the buffer"
    )
    return {"date": old["date"], "command": old["command"], "corpus": said, "figures": old["figures"]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=["extract", "offline", "online"])
    parser.add_argument("--work", type=Path)
    parser.add_argument("--port", type=int)
    parser.add_argument(
        "--train-rows", type=int, default=TRAIN_ROWS, help="training conversations in the corpus"
    )
    parser.add_argument("--buffer-tokens", type=int, default=BUFFER_TOKENS, help="train.online.buffer_tokens")
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(_phase(args.phase, args.work, args.port, args.buffer_tokens)))
    else:
        main(args.train_rows, args.buffer_tokens)
