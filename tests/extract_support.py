"""Small corpus results for extraction tests, written in the merge stage's contract: `train-*.parquet` /
`eval-*.parquet` (id, source, input_ids list[int32], loss_mask list[uint8], n_tokens, n_supervised)
and a manifest listing them under `splits.<split>.shards[]` (key, file, rows, tokens)."""

from __future__ import annotations

import os
import random
import signal
import threading
from pathlib import Path

import polars as pl
import psutil

from aerie.manifest import StageDir, StageResult, stage_key
from aerie.store import ArtifactStore

TOPICS = ["rivers", "bread", "compilers", "owls", "tides", "chess", "glass", "violins", "maps", "bees"]


def corpus_rows(tokenizer, n: int, seed: int = 0, min_words: int = 8, max_words: int = 40) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = rng.randint(min_words, max_words)
        topic = rng.choice(TOPICS)
        text = f"Tell me about {topic}. " + " ".join(rng.choice(TOPICS) for _ in range(words)) + "."
        ids = tokenizer(text)["input_ids"]
        half = len(ids) // 2
        mask = [0] * half + [1] * (len(ids) - half)
        rows.append({"id": f"c{seed}-{i}", "source": "test", "input_ids": ids, "loss_mask": mask})
    return rows


def write_corpus(
    store: ArtifactStore, run: str, splits: dict[str, list[dict]], rows_per_shard: int = 8
) -> StageResult:
    key = stage_key("merge", {"test": sorted(splits), "n": [len(v) for v in splits.values()]})
    stage = StageDir(store, run, "merge", key)
    out: dict[str, dict] = {}
    for split, rows in splits.items():
        shards = []
        for n, start in enumerate(range(0, len(rows), rows_per_shard)):
            part = rows[start : start + rows_per_shard]
            frame = pl.DataFrame(
                {
                    "id": [r["id"] for r in part],
                    "source": [r["source"] for r in part],
                    "input_ids": [r["input_ids"] for r in part],
                    "loss_mask": [r["loss_mask"] for r in part],
                },
                schema={
                    "id": pl.String,
                    "source": pl.String,
                    "input_ids": pl.List(pl.Int32),
                    "loss_mask": pl.List(pl.UInt8),
                },
            ).with_columns(
                n_tokens=pl.col("input_ids").list.len().cast(pl.Int32),
                n_supervised=pl.col("loss_mask").list.sum().cast(pl.Int32),
            )
            file = f"{split}-{n:05d}.parquet"
            local = Path(store.root) / "_tmp" / file if hasattr(store, "root") else Path(file)
            local.parent.mkdir(parents=True, exist_ok=True)
            frame.write_parquet(local)
            store.put_file(stage.path(file), local)
            local.unlink()
            shards.append(
                {
                    "key": stage.path(file),
                    "file": file,
                    "rows": frame.height,
                    "tokens": int(frame["n_tokens"].sum()),
                }
            )
        out[split] = {"records": len(rows), "tokens": sum(s["tokens"] for s in shards), "shards": shards}
    figures = {f"{s}_tokens": v["tokens"] for s, v in out.items()}
    figures["tokens"] = sum(v["tokens"] for v in out.values())
    return stage.finish({"splits": out, "figures": figures})


def listener_pid(port: int) -> int | None:
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            return conn.pid
    return None


class KillServer:
    """A progress callback that SIGKILLs server s0 (the one on `port`) at each of `when`, in turn:
    "canary" as s0 starts its canary; a fraction once s0 is ready (its canary passed), the extraction
    passed that fraction, and a tokens/s report came after s0 was ready (so it is extracting)."""

    def __init__(self, port: int, *when: str | float) -> None:
        self.port, self.when = port, list(when)
        self.ready = self.ticked = False
        self.killed: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, fraction: float, message: str) -> None:
        with self.lock:
            if message.startswith("server s0: ready at"):
                self.ready, self.ticked = True, False
            elif "tok/s" in message and self.ready:
                self.ticked = True
            if not self.when:
                return
            when = self.when[0]
            if when == "canary":
                due = message == "server s0: running the canary"
            else:
                due = self.ticked and fraction >= float(when)
            pid = listener_pid(self.port) if due else None
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                self.killed.append(pid)
                self.when.pop(0)
                self.ready = self.ticked = False
