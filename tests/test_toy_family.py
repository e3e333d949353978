"""A family added as `docs/extending.md` says (tests/toy_family.py: one module and one `register` line)
goes end to end with no edit anywhere else: trained by the train stage's own loop on hidden states of
the layers it names, measured by the evaluate stage with its proposer, planned with its parameter
count, and served by the reference server (`aerie.engine`), where it arrives as a plug-in, with the
algorithm its declaration names. Real parts throughout, on the embedded SmolLM2 target on the CPU."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from aerie.evaluate import work as evaluate_work
from aerie.evaluate.config import EvaluateConfig
from aerie.families import Family, family, register, unregister
from aerie.manifest import load_manifest
from aerie.presets import load_config
from aerie.serving import SpeculativeArgs
from aerie.train import work as train_work
from aerie.train.config import TrainConfig
from tests.stage_work import staged
from tests.toy_family import TOY, TOY_ENTRY_POINT, load_toy, toy_params
from tests.train_support import make_samples, make_upstream

pytestmark = pytest.mark.integration  # a reference server process

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def toy() -> Iterator[Family]:
    register(TOY)
    yield TOY
    unregister(TOY.name)


def _repeat_rate(samples) -> float:
    """How often an answer token repeats the one before it: what the toy's one weight learns."""
    hits = total = 0
    for s in samples:
        ids, mask = s.input_ids, s.loss_mask
        answer = mask[2:] & mask[1:-1]
        hits += int((ids[2:] == ids[1:-1])[answer].sum())
        total += int(answer.sum())
    return hits / max(1, total)


@pytest.mark.timeout(1200)
def test_a_toy_family_is_trained_evaluated_planned_and_served(toy: Family, smollm2, tmp_path, monkeypatch):
    torch.set_num_threads(1)
    cfg = TrainConfig(
        drafter={"family": "toy", "num_target_layers": 2},
        epochs=3, lr=0.5, warmup_ratio=0.0, batch_tokens=64, max_length=64, eval_every=2,
        checkpoint_every=4, log_every=1, device="cpu", cache_dir=str(tmp_path / "train-cache"),
    )  # fmt: skip
    layers = cfg.capture_layers(smollm2.geometry.num_layers)
    model = smollm2.load_model("cpu", "float32")
    train = make_samples(model, smollm2, n=4, prompt=6, response=24, seed=0, layers=layers)
    held = make_samples(model, smollm2, n=2, prompt=6, response=24, seed=1, layers=layers)
    up = make_upstream(tmp_path, smollm2, train, held, layers=layers)

    # Train: the stage's own work, the loop driving the toy's objective; its export is the best step's.
    trained = staged("train", train_work.run)(
        cfg, store=up.store, run_name="toy", target=smollm2, shards=up.shards, corpus=up.corpus
    )
    manifest = load_manifest(up.store, trained.prefix)
    assert manifest["family"] == "toy" and manifest["layers"]["output_convention"] == layers
    drafter_dir = up.store.local_path(f"{trained.prefix}/drafter")
    assert drafter_dir is not None
    learned = float(load_toy(drafter_dir, smollm2).repeat_logit.detach())
    # The weight moved from 0 toward the side the training answers are on (it is a logistic fit).
    rate = _repeat_rate(train)
    assert learned != 0.0 and (learned > 0) == (rate > 0.5), (learned, rate)

    # Evaluate: the stage's work given the run's family, its proposer beside prompt lookup, lossless.
    ev = EvaluateConfig(
        num_steps=[3], temperatures=[0.0], max_new_tokens=8, mtbench_questions=2, heldout_samples=0,
        batch_size=2, device="cpu",
    ).measuring(toy.name)  # fmt: skip
    evaluated = staged("evaluate", evaluate_work.run)(
        ev, store=up.store, run_name="toy", target=smollm2, drafter=trained, corpus=up.corpus, family=toy
    )
    report = json.loads(up.store.get_bytes(f"{evaluated.prefix}/report.json"))
    assert {r["proposer"] for r in report["results"]} == {"toy", "prompt_lookup"}
    assert report["agreement"]["identical"] == report["agreement"]["compared"] > 0  # lossless
    toy_row = next(r for r in report["results"] if r["proposer"] == "toy")
    assert 1.0 <= toy_row["accept_length"] <= 4.0 and toy_row["spec_verify_ct"] > 0

    # Plan: the planner sizes and times the toy's training by the family's own count.
    from aerie.plan import make_plan
    from aerie.plan.disk import drafter_params
    from aerie.plan.facts import hardware, target_facts
    from aerie.plan.throughput import Model, draft_flops

    run_cfg = load_config("smollm2-local", ["train.drafter=toy", "deploy.enabled=false"])
    facts = target_facts(run_cfg.target)
    params = toy_params(run_cfg.train.drafter, run_cfg.train, facts.geometry)
    assert drafter_params(run_cfg, facts) == params
    assert draft_flops(Model(run_cfg, facts, hardware("h100")), 512) == 6 * params
    estimates = {s.stage: s for s in make_plan(run_cfg, "h100").stages}
    assert estimates["train"].seconds > 0

    # Serve: the reference server in its own process finds the toy through its entry point and serves the
    # trained export under the family's algorithm; the reply is the target's greedy text.
    from aerie.engine.speculative.decoder import greedy_reference
    from tests.refserver_support import launch, wait_ready

    site = tmp_path / "site"
    info = site / "aerie_toy_family-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: aerie-toy-family\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[aerie.families]\n{TOY_ENTRY_POINT}\n")
    monkeypatch.setenv("PYTHONPATH", f"{site}:{ROOT}")
    algorithm = family("toy").served_algorithm
    server = launch(
        smollm2.path,
        tmp_path,
        "--device",
        "cpu",
        *SpeculativeArgs(str(drafter_dir), num_steps=3, algorithm=algorithm).to_args(),
    )
    try:
        wait_ready(server, timeout=300)
        text, new = "Count: 1, 1, 1, 1, 1,", 8
        reply = httpx.post(
            server.url + "/generate",
            json={"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": new}},
            timeout=300,
        )
    finally:
        server.stop()
    assert reply.status_code == 200, reply.text
    item = reply.json()
    ids = list(smollm2.load_tokenizer()(text).input_ids)
    assert item["output_ids"] == greedy_reference(model, ids, new, smollm2.eos_token_ids)
    assert item["meta_info"]["spec_verify_ct"] > 0
