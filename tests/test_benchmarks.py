"""benchmarks/stages/extract.py end to end, tiny (a smoke run, not a measurement): every part runs and the
record holds the figures the README quotes. A refactor of the script once broke every untraced
pipeline variant unnoticed until a GPU run; this catches that here. Its record goes to tmp_path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # the benchmark script and its servers run as child processes

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_extraction_benchmark_runs_every_part_and_records_its_figures(tmp_path, smollm2):
    out = tmp_path / "extract.json"
    args = [
        "--samples", "10", "--max-len", "96", "--pack-tokens", "256", "--batch-tokens", "512",
        "--server-batch-tokens", "512", "--shard-mb", "1", "--sustained-gib", "0", "--baseline-samples", "2",
        "--pipelines", "fp8+server,bf16", "--work-dir", str(tmp_path / "work"), "--results", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "stages" / "extract.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,  # ~2 minutes where fp32 matrices multiply at 165 GFLOPS; over 400 s at 48
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["complete"] and record["command"].endswith(" ".join(args))
    figures = record["figures"]
    assert figures["bare_forward"]["best_tokens_per_s"] > 0
    assert figures["baseline_one_sample_one_file"]["tokens_per_s"] > 0
    assert set(figures["pipeline"]) == {"fp8+server", "bf16"}
    for name, run in figures["pipeline"].items():
        assert run["tokens"] == figures["corpus_tokens"], name  # every corpus token was extracted
        assert run["efficiency"] > 0 and run["speedup_vs_baseline"] > 0, name
        assert run["roofline_bound"] in ("forward", "storage"), name
    assert figures["pipeline"]["fp8+server"]["quantized_on"] == "server"
    # SmolLM2 (H=576, uint16 ids): 2,311 B/token in fp8 shards, 4,611 in bf16.
    assert 0.49 < figures["fp8_bytes_vs_bf16"] < 0.51 and figures["fp8_bytes_vs_peers_bf16"] < 0.5
