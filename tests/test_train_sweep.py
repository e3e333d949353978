"""benchmarks/quality/train_sweep.py end to end on the CPU: the embedded default's tiny run, extracted once per
drafter family, three recipes trained on the same shards, each kept by held-out acceptance, one record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import pipeline_support
from tests.conftest import free_port

pytestmark = pytest.mark.integration  # reference servers (generation and extraction)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1500)
def test_the_sweep_trains_recipes_on_shared_shards_and_records_them(tmp_path: Path) -> None:
    overrides = pipeline_support.tiny_overrides(tmp_path / "artifacts", run="sweep", port=free_port())
    out = tmp_path / "sweep.json"
    tiny = ["train.batch_sequences=2", "train.batch_tokens=96"]
    command = [
        sys.executable, str(ROOT / "benchmarks/quality/train_sweep.py"), "smollm2-local", "--until", "train",
        "--out", str(out), "--common", *overrides, "deploy.enabled=false", "--final", "train.epochs=2",
        "--variant", "eagle3_current",
        "--variant", "eagle3_converged", "recipe=eagle3_converged", *tiny,
        "--variant", "dflash_authors", "recipe=dflash_authors", *tiny, "train.drafter.anchors_per_sequence=8",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["complete"] and record["until"] == "train" and record["card"] == "cpu"
    v = {x["name"]: x for x in record["variants"]}
    assert list(v) == ["eagle3_current", "eagle3_converged", "dflash_authors"]
    # One extraction per family: the second EAGLE-3 variant reads the first one's shards.
    assert v["eagle3_converged"]["extract"] == {**v["eagle3_current"]["extract"], "cache_hit": True}
    assert v["dflash_authors"]["extract"]["key"] != v["eagle3_current"]["extract"]["key"]
    assert v["eagle3_converged"]["settings"]["lr"] == 6e-4
    assert v["eagle3_converged"]["settings"]["epochs"] == 2  # --final over the recipe's 10
    assert v["eagle3_converged"]["settings"]["loss_normalization"] == "sequence"
    assert v["dflash_authors"]["settings"]["drafter"]["block_size"] == 16
    for name in ("eagle3_current", "eagle3_converged", "dflash_authors"):
        train = v[name]["train"]
        held = train["heldout"]
        # The kept step is the best held-out evaluation of the curve, and its figures are recorded.
        assert held["accept_length_rounds"] == max(c["accept_length_rounds"] for c in train["curve"])
        assert held["accept_length_rounds"] == train["figures"]["accept_length_rounds"] >= 1.0
        settings = v[name]["settings"]
        # EAGLE-3's unroll: train.drafter.ttt_length (a record written before it moved: train.ttt_length).
        unroll = settings["drafter"].get("ttt_length", settings.get("ttt_length"))
        width = 15 if name == "dflash_authors" else unroll
        assert len(held["cond_acc"]) == width and train["wall_s"] > 0 and train["figures"]["train_tokens"] > 0
    assert set(record["winners"]) == {"eagle3", "dflash"}
    assert record["winners"]["dflash"]["variant"] == "dflash_authors"

    # A budget already spent starts nothing, and still writes the record.
    late = tmp_path / "late.json"
    command[command.index(str(out))] = str(late)
    again = subprocess.run([*command, "--budget-s", "1", "--reserve-s", "60"], cwd=ROOT, capture_output=True)
    assert again.returncode == 0, again.stderr[-3000:]
    skipped = json.loads(late.read_text())
    assert skipped["complete"] and [x.get("skipped", "").endswith("s left") for x in skipped["variants"]] == [
        True, True, True,
    ]  # fmt: skip
