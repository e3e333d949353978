"""Trackers and drafter cards on a real tiny pipeline run (every stage for real, without Prefect):
`train.report_to=[tensorboard,mlflow,wandb]` leaves a TensorBoard log, an MLflow run and a W&B offline
run whose loss curves are the manifest's metrics, each read back with the tracker's own reader; every
drafter directory the run wrote holds its card, and the promoted one adds the served figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from aerie.config import apply_overrides
from aerie.draft.card import CARD, VLLM_CONFIG, CardFacts, card_markdown
from aerie.errors import ConfigError
from aerie.pipeline import run_pipeline
from aerie.presets import get_preset
from aerie.progress import no_progress
from aerie.trackers import check_installed, flatten, numeric
from tests import pipeline_support
from tests.conftest import free_port
from tests.tracker_support import (
    mlflow_history,
    mlflow_runs,
    tensorboard_scalars,
    tensorboard_texts,
    wandb_offline_run,
)

RUN = "tracked"
# The module's pipeline run (every stage, two served benchmarks) is its first test's: past the default
# hang guard on a shared 2-core machine.
pytestmark = pytest.mark.timeout(3000)


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> dict[str, Any]:
    """One tiny pipeline run reporting to all three trackers; promoted whatever its speed-up (a margin
    of 0.01), so the promoted card is written."""
    store = tmp_path_factory.mktemp("trackers") / "artifacts"
    overrides = [
        *pipeline_support.tiny_overrides(store, run=RUN, port=free_port()),
        "train.report_to=[tensorboard,mlflow,wandb]",
        "train.log_every=1",  # a point per step: a curve, not the last step alone
        "deploy.promote_margin=0.01",
    ]
    report = run_pipeline(
        apply_overrides(get_preset("smollm2-local"), overrides),
        until="deploy",
        progress=lambda _n: no_progress,
    )
    results = {r.stage: r for r in report.results}
    manifests = {
        stage: json.loads((store / r.prefix / "manifest.json").read_text()) for stage, r in results.items()
    }
    return {"store": store, "results": results, "manifests": manifests, "trackers": store / RUN / "trackers"}


def _train_records(tracked: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    metrics = tracked["store"] / tracked["results"]["train"].prefix / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in records if r["kind"] == kind]


@pytest.mark.integration
@pytest.mark.slow
def test_tensorboard_log_holds_the_manifests_loss_curve_and_acceptance(tracked):
    train = tracked["results"]["train"]
    log_dir = tracked["trackers"] / "tensorboard" / f"train-{train.key}"
    scalars = tensorboard_scalars(log_dir)
    steps = _train_records(tracked, "train")
    assert steps
    loss = {r["step"]: pytest.approx(r["loss"], rel=1e-6) for r in steps}
    assert scalars["train/loss"] == loss
    assert scalars["train/lr"] == {r["step"]: pytest.approx(r["lr"], rel=1e-6) for r in steps}
    assert set(scalars["train/tokens_per_s"]) == set(loss)
    evals = _train_records(tracked, "eval")
    for position, _ in enumerate(evals[-1]["acc"]):
        assert scalars[f"eval/acc/pos{position}"] == {
            r["step"]: pytest.approx(r["acc"][position], rel=1e-6) for r in evals
        }
    assert scalars["train/accept_length_rounds"] == {
        evals[-1]["step"]: pytest.approx(train.figures["accept_length_rounds"], rel=1e-6)
    }
    (params,) = tensorboard_texts(log_dir)
    assert f"| provenance.key | {train.key} |" in params
    assert "| train.report_to |" in params


@pytest.mark.integration
@pytest.mark.slow
def test_mlflow_runs_hold_the_loss_curve_config_and_each_stages_figures(tracked):
    db = tracked["trackers"] / "mlflow.db"
    runs = mlflow_runs(db, RUN)
    assert set(runs) == {"train", "evaluate", "deploy"}
    train = runs["train"]
    assert train.info.status == "FINISHED"
    steps = _train_records(tracked, "train")
    assert mlflow_history(db, train.info.run_id, "train/loss") == {r["step"]: r["loss"] for r in steps}
    manifest = tracked["manifests"]["train"]
    assert train.data.params["train.lr"] == json.dumps(manifest["training"]["config"]["lr"])
    assert train.data.params["provenance.target_revision"] == manifest["target"]["revision"]
    assert train.data.params["provenance.corpus"] == tracked["results"]["merge"].prefix
    for stage in ("evaluate", "deploy"):
        # The stage's own figures, as its manifest holds them (the pipeline adds its plan's estimate after).
        figures = numeric(tracked["manifests"][stage]["figures"])
        assert figures
        logged = runs[stage].data.metrics
        assert logged == pytest.approx({f"{stage}/{k}": v for k, v in figures.items()})
        assert runs[stage].data.params["provenance.drafter"] == tracked["results"]["train"].prefix


@pytest.mark.integration
@pytest.mark.slow
def test_wandb_offline_run_parsed_holds_the_loss_curve(tracked):
    train = tracked["results"]["train"]
    (run_file,) = (tracked["trackers"] / "wandb").glob(f"offline-run-*-{RUN}-train-{train.key}/*.wandb")
    parsed = wandb_offline_run(run_file)
    losses = {row["step"]: row["train/loss"] for row in parsed["history"] if "train/loss" in row}
    assert losses == {r["step"]: r["loss"] for r in _train_records(tracked, "train")}
    assert parsed["config"]["provenance.key"] == train.key


@pytest.mark.integration
@pytest.mark.slow
def test_every_drafter_directory_holds_its_card(tracked):
    store, results, manifests = tracked["store"], tracked["results"], tracked["manifests"]
    evaluated = _card(store / results["train"].prefix / "drafter" / CARD)
    promoted = _card(store / RUN / "promoted" / "drafter" / CARD)
    target = manifests["train"]["target"]["name"]
    for front, body in (evaluated, promoted):
        assert front == {
            "base_model": target,
            "library_name": "sglang",
            "tags": ["speculative-decoding", "eagle3", "draft-model", "aerie"],
        }
        assert "--speculative-algorithm EAGLE3" in body
        assert ("vllm serve" in body) == (store / results["train"].prefix / "drafter" / VLLM_CONFIG).is_file()
        # The acceptance per prompt set and position, as the evaluation measured it.
        for r in manifests["evaluate"]["results"]:
            t = r.get("temperature") or 0
            proposer = r["proposer"] + (f" (t={t:g})" if t else "")  # each sampled temperature its own row
            row = f"| {r['dataset']} | {proposer} | {r['num_steps']} | {r['accept_length']:,.4g} |"
            shown = [line for line in body.splitlines() if line.startswith(f"| {r['dataset']} |")]
            assert row in body, (row, shown)
        assert f"`{RUN}/merge/{results['merge'].key}`" in body
    assert "## Served speed-up" not in evaluated[1]
    assert f"--speculative-num-steps {manifests['deploy']['num_steps']}" in promoted[1]
    speculative = [r for r in manifests["deploy"]["rows"] if r["server"] == "speculative"]
    for r in speculative:
        assert f"| {r['concurrency']} |" in promoted[1] and f"{r['speedup']:,.4g}x" in promoted[1]
    assert manifests["deploy"]["promotion"]["reason"] in promoted[1]
    assert f"drafter/{CARD}" in manifests["train"]["files"]["drafter"]


def _card(path: Path) -> tuple[dict[str, Any], str]:
    text = path.read_text()
    assert text.startswith("---\n")
    front, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(front), body


@pytest.mark.integration
@pytest.mark.slow
def test_a_card_names_vllm_only_where_its_layout_is_there(tracked):
    facts = CardFacts(train=tracked["manifests"]["train"], drafter_dir="/srv/drafter")
    assert "vllm serve" not in card_markdown(facts)
    with_vllm = card_markdown(CardFacts(train=facts.train, drafter_dir="/srv/drafter", vllm=True))
    assert '"model": "/srv/drafter/vllm"' in with_vllm
    assert "Not evaluated yet" in with_vllm


def test_parameters_flatten_and_metrics_keep_finite_numbers():
    assert flatten({"train": {"lr": 0.001, "report_to": ["mlflow"], "draft": {}}, "run": "x"}) == {
        "train.lr": "0.001",
        "train.report_to": '["mlflow"]',
        "train.draft": "{}",
        "run": "x",
    }
    assert numeric({"acc": [0.5, 0.25], "loss": float("nan"), "ok": True, "text": "1/2", "n": 3}) == {
        "acc/pos0": 0.5,
        "acc/pos1": 0.25,
        "n": 3.0,
    }


def test_an_unknown_tracker_is_named():
    with pytest.raises(ConfigError, match="unknown tracker 'swanlab'"):
        check_installed(["swanlab"])
