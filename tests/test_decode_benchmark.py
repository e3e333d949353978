"""benchmarks/stages/decode.py, tiny and on the CPU (a smoke run, not a measurement): several shapes in one run,
each run's length figures, the random-weights mode a host without the checkpoint measures with, and the
refusal of a malformed shape. Its record goes to tmp_path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "stages"))

import decode  # noqa: E402

from aerie.engine.generation import GenRequest, SamplingParams  # noqa: E402


def request(prompt: int, new: int) -> GenRequest:
    return GenRequest("r", [5] * prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))


def test_mean_context_counts_the_positions_each_generated_token_is_decoded_against():
    requests = [request(10, 3), request(100, 1)]
    # Token i (1-based) of a request is decoded against prompt + i positions.
    contexts = [10 + i for i in range(1, 4)] + [100 + 1]
    figures = decode.length_figures(requests)
    assert figures["mean_context"] == round(sum(contexts) / len(contexts), 1)
    assert figures["mean_prompt_tokens"] == 55.0 and figures["mean_new_tokens"] == 2.0


@pytest.mark.parametrize("shape", ["16,256", "16:64,384", "x,2:3,4", "300,200:1,2"])
def test_a_malformed_shape_is_refused_with_what_it_should_be(shape):
    with pytest.raises(SystemExit, match="decode.py: .*" + shape.split(":")[0].split(",")[0]):
        decode.parse_shape(shape)


@pytest.mark.integration  # the benchmark script runs as a child process
def test_several_shapes_with_random_weights_from_a_config_run_backend_by_backend(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2,  # layer 2: the capture decode.py names
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path / "target")
    out = tmp_path / "decode.json"
    args = [
        "--target-config", str(tmp_path / "target"), "--backends", "slots,batched", "--concurrency", "2",
        "--requests-per-slot", "1", "--shapes", "8,16:2,4", "32,48:3,5", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "stages" / "decode.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(out.read_text())
    figures = record["figures"]
    assert record["complete"] and figures["weights"].startswith("random, from ")
    assert "prompt_len" not in figures  # several shapes: each run carries its own
    order = [(r["backend"], tuple(r["prompt_len"])) for r in figures["runs"]]
    assert order == [("slots", (8, 16)), ("slots", (32, 48)), ("batched", (8, 16)), ("batched", (32, 48))]
    for run in figures["runs"]:
        assert run["requests_finished"] == run["requests_total"] == 2
        lo, hi = run["prompt_len"]
        assert lo < run["mean_context"] < hi + run["new_tokens"][1]
        assert run["generated_tokens"] == round(2 * run["mean_new_tokens"])
