"""How fast the dataset loaders read: the full ShareGPT file (stream parse + normalization) and a
synthetic Parquet file, on one core. Writes benchmarks/results/datasets-cpu.json.

    .venv/bin/python benchmarks/stages/datasets.py [--repeat 3] [--parquet-rows 50000]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

from aerie.datasets import LoadReport, SourceSpec, iter_conversations, sharegpt_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository importable
from benchmarks import records  # noqa: E402

OUT = records.RESULTS / "datasets-cpu.json"
CODE_PATHS = ["benchmarks/stages/datasets.py", "aerie/datasets.py"]


def _timed(spec: SourceSpec, repeat: int) -> tuple[float, LoadReport]:
    """Best of `repeat` full reads (the machine is shared: the minimum is the least disturbed)."""
    best, report = float("inf"), LoadReport(source="bench")
    for _ in range(repeat):
        report = LoadReport(source="bench")
        start = time.perf_counter()
        for _conversation in iter_conversations(spec, "bench", report=report):
            pass
        best = min(best, time.perf_counter() - start)
    return best, report


def _synthetic_parquet(path: Path, rows: int) -> None:
    turn = "lorem ipsum dolor sit amet " * 20
    pl.DataFrame(
        {
            "id": [f"r{i}" for i in range(rows)],
            "messages": [
                [{"role": "user", "content": turn}, {"role": "assistant", "content": turn}]
                for _ in range(rows)
            ],
        }
    ).write_parquet(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--parquet-rows", type=int, default=50_000)
    args = parser.parse_args()

    path = sharegpt_path()
    seconds, report = _timed(SourceSpec(kind="sharegpt"), args.repeat)
    mib = path.stat().st_size / 2**20
    figures: dict[str, object] = {
        "sharegpt_seconds": round(seconds, 3),
        "sharegpt_mib": round(mib, 1),
        "sharegpt_mib_per_s": round(mib / seconds, 1),
        "sharegpt_records": report.records,
        "sharegpt_turns": report.turns,
        "sharegpt_loaded": report.loaded,
        "sharegpt_conversations_per_s": round(report.loaded / seconds),
        "sharegpt_skipped": report.skipped,
        "sharegpt_repaired": report.repaired,
        # Peak resident memory so far (kB on Linux): imports plus the ~1 MiB sliding buffer.
        "peak_rss_mib_after_sharegpt": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    with tempfile.TemporaryDirectory() as tmp:
        parquet = Path(tmp) / "synthetic.parquet"
        _synthetic_parquet(parquet, args.parquet_rows)
        spec = SourceSpec(
            kind="parquet",
            path=str(parquet),
            messages_field="messages",
            role_field="role",
            content_field="content",
        )
        pq_seconds, pq_report = _timed(spec, args.repeat)
        figures["parquet_rows"] = pq_report.loaded
        figures["parquet_seconds"] = round(pq_seconds, 3)
        figures["parquet_conversations_per_s"] = round(pq_report.loaded / pq_seconds)
    # Peak resident memory of the whole script (kB on Linux): the stream parse holds ~1 MiB of text.
    figures["peak_rss_mib_whole_script"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

    records.write(OUT, {**records.header(CODE_PATHS), "figures": figures})


if __name__ == "__main__":
    main()
