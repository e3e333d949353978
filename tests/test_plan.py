"""`aerie plan`: sizes from the real datasets, rates from the benchmark records, and each refusal.

No server runs: the planner reads the datasets, the target's config and the recorded rates only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from aerie.cli import main
from aerie.errors import ConfigError, ContextLengthError, GpuMemoryError, NotEnoughDiskError
from aerie.plan import check, make_plan
from aerie.plan.disk import drafter_params, dumps_in_flight_bytes, shard_bytes_per_token
from aerie.plan.facts import calibration_entries, figure_at, hardware, target_facts
from aerie.plan.render import table
from aerie.presets import load_config

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
# A Kimi plan over the first 50 ShareGPT conversations: the whole source takes a pass the tests skip.
KIMI_SMALL = ["generate.datasets.0.num_samples=50"]
STAGE_ORDER = ("generate", "merge", "extract", "train", "evaluate", "deploy")


@pytest.mark.parametrize(
    ("hardware", "key"), [(hw, key) for hw, rates in calibration_entries().items() for key in rates]
)
def test_every_calibration_figure_is_its_records(hardware: str, key: str) -> None:
    entry = calibration_entries()[hardware][key]
    record = json.loads((RESULTS / entry["source"]).read_text())
    assert figure_at(record, entry["path"]) == entry["value"], (
        f"{hardware}.{key} differs from {entry['source']}"
    )


def test_shard_and_dump_bytes_follow_the_extractor() -> None:
    from aerie.extract import preflight
    from aerie.shards import schema as shards

    cfg = load_config("kimi-k2.5-8gpu", KIMI_SMALL)
    kimi = target_facts(cfg.target)
    for storage in ("bf16", "fp8"):
        for vocab in (49152, 163840):
            assert shard_bytes_per_token(storage, 7168, vocab) == shards.bytes_per_token(storage, 7168, vocab)
    assert dumps_in_flight_bytes(cfg, kimi) == preflight.dumps_in_flight_bytes(
        cfg.extract, kimi.geometry.hidden_size, kimi.geometry.vocab_size
    )


def test_drafter_parameters_match_a_real_checkpoint(smollm2) -> None:
    import torch

    from aerie.draft.model import DraftConfig, Eagle3Drafter

    cfg = load_config("smollm2-local", [])
    facts = target_facts(cfg.target)
    g = facts.geometry
    draft = DraftConfig(
        hidden_size=g.hidden_size,
        intermediate_size=g.intermediate_size,
        num_attention_heads=g.attention.num_heads,
        num_key_value_heads=g.attention.num_kv_heads,
        head_dim=g.attention.head_dim,
        vocab_size=g.vocab_size,
        draft_vocab_size=cfg.train.drafter.draft_vocab_size,
        rope_theta=smollm2.geometry.rope.theta,
        max_position_embeddings=smollm2.geometry.max_position_embeddings,
        aux_layer_ids=tuple(smollm2.aux_layers_output),
    )
    model = Eagle3Drafter(draft, torch.zeros(g.vocab_size, g.hidden_size))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad and p.dim() == 2)
    assert drafter_params(cfg, facts) == pytest.approx(trainable, rel=0.01)


def test_sizes_come_from_the_dataset_and_the_sampling() -> None:
    plan = check(make_plan(load_config("smollm2-local", [])))
    (sharegpt,) = plan.sizes.datasets
    assert sharegpt.conversations == 24 and sharegpt.turns == 24  # num_samples 24, max_turns 1
    assert 0 < sharegpt.completion_tokens <= 24 * 64  # capped at max_tokens per answer
    assert plan.sizes.corpus_tokens <= 24 * 256  # corpus.max_length
    longer = make_plan(load_config("smollm2-local", ["generate.datasets.0.sampling.max_tokens=128"]))
    assert longer.sizes.datasets[0].completion_tokens > sharegpt.completion_tokens
    assert plan.hardware.name == "cpu" and plan.gpu_seconds == 0


def test_kimi_plan_prices_the_api_tokens_with_their_date() -> None:
    plan = make_plan(load_config("kimi-k2.5-8gpu", KIMI_SMALL))
    s = plan.sizes
    assert plan.cost.total_usd == pytest.approx(
        s.prompt_tokens / 1e6 * 0.60 + s.completion_tokens / 1e6 * 3.00
    )
    text = table(plan)
    assert "2026-01-27" in text and "GPU time" in text and "S3:" in text
    assert plan.stage("extract").gpus == 8  # type: ignore[union-attr]


def test_kimi_is_evaluated_served_since_no_one_gpu_holds_it() -> None:
    served = make_plan(load_config("kimi-k2.5-8gpu", KIMI_SMALL))
    assert served.stage("evaluate") is None and served.stage("deploy") is not None
    offline = make_plan(load_config("kimi-k2.5-8gpu", [*KIMI_SMALL, "evaluate.enabled=true"]))
    with pytest.raises(GpuMemoryError, match=r"the offline evaluator loads moonshotai/Kimi-K2.5 on one GPU"):
        check(offline)


def test_a_price_needs_its_date() -> None:
    with pytest.raises(ConfigError, match="prices_date"):
        load_config("kimi-k2.5-8gpu", ["generate.endpoint.prices_date=null"])


def test_refuses_a_sequence_beyond_the_target_context() -> None:
    plan = make_plan(load_config("smollm2-local", ["corpus.max_length=16384"]))
    with pytest.raises(ContextLengthError, match=r"corpus.max_length = 16,384.*context of 8,192"):
        check(plan)


def test_refuses_a_target_larger_than_its_gpus() -> None:
    plan = make_plan(load_config("kimi-k2.5-8gpu", [*KIMI_SMALL, "server.tp_size=2"]))
    with pytest.raises(GpuMemoryError, match=r"server.tp_size 2 = 298 GB per GPU.*server.tp_size=5"):
        check(plan)


def test_refuses_a_training_step_larger_than_the_gpu() -> None:
    cfg = load_config(
        "smollm2-local", ["server.device=cuda", "train.device=cuda", "train.batch_tokens=262144"]
    )
    with pytest.raises(GpuMemoryError, match=r"train.batch_tokens 262,144: a step needs about 240 GiB"):
        check(make_plan(cfg))
    assert check(
        make_plan(cfg.model_copy(update={"train": cfg.train.model_copy(update={"batch_tokens": 32768})}))
    )


def test_refuses_a_store_on_a_filesystem_too_small(tmp_path: Path) -> None:
    cfg = load_config("smollm2-local", [f"store.uri={tmp_path / 'store'}"])
    per_checkpoint = 12 * drafter_params(cfg, target_facts(cfg.target))
    keep = shutil.disk_usage(tmp_path).free // per_checkpoint + 2  # the checkpoints alone overflow it
    plan = make_plan(
        load_config("smollm2-local", [f"store.uri={tmp_path / 'store'}", f"train.keep_checkpoints={keep}"])
    )
    with pytest.raises(NotEnoughDiskError, match=rf"{tmp_path / 'store'}.*checkpoints .* free \(short by"):
        check(plan)


def test_unmeasured_hardware_prints_how_it_was_scaled() -> None:
    plan = make_plan(load_config("smollm2-local", ["server.device=cuda", "train.device=cuda"]), "a100")
    assert "a100 has no measurements: the H200's rate scaled by peak_flops x0.32" in table(plan)


def test_cli_prints_the_plan_and_exits_2_on_a_refusal(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["plan", "smollm2-local", "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "GPU time" in out and "disk (at its fullest)" in out
    assert json.loads((tmp_path / "plan.json").read_text())["stages"][0]["stage"] == "generate"
    assert main(["plan", "smollm2-local", "train.max_length=9000"]) == 2
    assert "train.max_length = 9,000" in capsys.readouterr().err


def test_the_actual_sits_beside_its_estimate_and_a_slow_stage_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from aerie.manifest import StageDir, load_manifest, manifest_digest
    from aerie.plan import track
    from aerie.store import open_store

    store = open_store(str(tmp_path / "store"))
    result = StageDir(store, "r", "merge", "k").finish({"figures": {"records": 3}})
    plan = make_plan(load_config("smollm2-local", []))
    estimate = plan.stage("merge").seconds  # type: ignore[union-attr]
    slow = result.model_copy(update={"seconds": 3 * estimate})
    with caplog.at_level("WARNING", logger="aerie.plan"):
        (annotated,) = track.after(plan, store, "merge", [slow])
    assert "more than 2x its estimate" in caplog.text
    assert annotated.figures["estimate_s"] == round(estimate, 1)
    manifest = load_manifest(store, result.prefix)
    assert manifest["plan"]["actual_s"] == round(3 * estimate, 1)
    assert manifest_digest(manifest) == result.manifest_sha256  # downstream keys are unchanged
    assert track.gpu_seconds(plan, store, [annotated]) == 0.0  # merge uses no GPU


def test_decode_rate_interpolates_between_the_measured_points_and_clamps_outside() -> None:
    from aerie.plan.throughput import decode_rate_at

    points = [(1324.6, 14299.0), (265.1, 22387.3), (607.3, 21024.0)]  # any order
    for context, rate in points:
        assert decode_rate_at(points, context) == pytest.approx(rate)
    midway = decode_rate_at(points, (607.3 + 1324.6) / 2)
    assert midway == pytest.approx((21024.0 + 14299.0) / 2)
    assert decode_rate_at(points, 10.0) == 22387.3 and decode_rate_at(points, 50_000.0) == 14299.0
    grid = [decode_rate_at(points, 100.0 + 25 * i) for i in range(80)]
    assert all(a >= b for a, b in zip(grid, grid[1:], strict=False)), "a longer context never decodes faster"


def test_the_plan_reads_its_context_points_from_the_calibration() -> None:
    from aerie.plan.throughput import Model, context_points

    cfg = load_config("smollm2-gpu", KIMI_SMALL)
    points = context_points(Model(cfg, target_facts(cfg.target), hardware("h200")))
    entries = calibration_entries()["h200"]
    assert len(points) == 3
    assert points[0] == (
        entries["decode_graphs_context_0_tokens"]["value"],
        entries["decode_graphs_context_0_tokens_per_s"]["value"],
    )


def test_a_longer_context_dataset_generates_slower() -> None:
    import dataclasses

    from aerie.plan.throughput import estimate, mean_decode_context

    cfg = load_config("smollm2-gpu", KIMI_SMALL)
    target, hw = target_facts(cfg.target), hardware("h200")
    plan = make_plan(cfg, "h200")
    # The same tokens in half the requests: each request's prompt and answer twice as long.
    longer = dataclasses.replace(
        plan.sizes,
        datasets=[dataclasses.replace(d, turns=max(1, d.turns // 2)) for d in plan.sizes.datasets],
    )
    assert mean_decode_context(longer) > mean_decode_context(plan.sizes)
    short_s = estimate(cfg, target, plan.sizes, hw)[0].seconds
    long_est = estimate(cfg, target, longer, hw)[0]
    assert long_est.stage == "generate" and long_est.seconds > short_s
    assert any("decode_context-h200.json" in c for c in long_est.calibrated_by)


def test_once_the_corpus_exists_the_later_stages_are_planned_from_it(caplog) -> None:
    from aerie.manifest import StageResult
    from aerie.plan import track

    plan = make_plan(load_config("smollm2-gpu", ["generate.datasets.0.num_samples=300"]), "h200")
    est = plan.sizes
    # A corpus three times the sample's estimate (what regenerated answers longer than the data's give).
    figures = {
        "records": est.corpus_records,
        "tokens": 3 * est.corpus_tokens,
        "supervised_tokens": 3 * est.supervised_tokens,
        "train_tokens": 3 * (est.corpus_tokens - est.eval_tokens),
        "eval_tokens": 3 * est.eval_tokens,
        "eval_records": est.eval_records + 1,
    }
    merge = StageResult(
        stage="merge",
        key="k",
        prefix="r/merge/k",
        manifest_uri="m",
        manifest_sha256="0",
        cache_hit=False,
        seconds=1.0,
        figures=figures,
    )
    refined = track.refined(plan, "merge", [merge])
    assert refined is not None and refined is not plan
    cfg = plan.cfg
    assert refined.sizes.train_tokens == round(
        3 * (est.corpus_tokens - est.eval_tokens) * cfg.train.train_fraction * cfg.train.epochs
    )
    assert refined.sizes.eval_records == est.eval_records + 1
    for name in ("generate", "merge"):  # what already ran keeps its estimate
        assert refined.stage(name) == plan.stage(name)
    # Three times the tokens: training about three times as long; extraction longer (its start is fixed).
    assert refined.stage("train").seconds > 2 * plan.stage("train").seconds  # type: ignore[union-attr]
    assert refined.stage("extract").seconds > plan.stage("extract").seconds  # type: ignore[union-attr]
    assert refined.disk.locations != plan.disk.locations
    # Only the merge stage's results refine it; figures it cannot read leave it as it was, with a warning.
    assert track.refined(plan, "extract", [merge]) is plan
    broken = merge.model_copy(update={"figures": {"records": 1}})
    assert track.refined(plan, "merge", [broken]) is plan
    assert "keeps its corpus estimate" in caplog.text


def test_a_cpu_stage_is_its_fixed_seconds_plus_its_work_at_this_machines_speed() -> None:
    """The CPU records come from machines of differing speeds: each CPU stage's variable part (the work
    at the records' rates) is multiplied by the factor two calibration runs measured, and its own fixed
    seconds added; evaluation and deployment, whose work was the same in both runs, have none."""
    cfg = load_config("smollm2-local", [])
    cpu = {k: v["value"] for k, v in calibration_entries()["cpu"].items()}
    variable = {e.stage: e.seconds for e in make_plan(cfg, "cpu", fixed=False).stages}
    planned = {e.stage: e for e in make_plan(cfg, "cpu").stages}
    assert set(planned) == set(STAGE_ORDER)
    for stage in STAGE_ORDER:
        fixed = cpu.get(f"fixed_{stage}_s", 0.0)
        want = fixed + cpu[f"speed_{stage}"] * variable[stage]
        assert planned[stage].seconds == pytest.approx(want, rel=1e-6), stage
        assert "plan_calibration-cpu.json" in " ".join(planned[stage].calibrated_by)
    assert any(abs(cpu[f"speed_{s}"] - 1) > 0.1 for s in STAGE_ORDER)  # the factors are not all 1
    on_h200 = {e.stage: e for e in make_plan(load_config("smollm2-gpu", []), "h200").stages}
    assert not any("plan_calibration-cpu.json" in " ".join(e.calibrated_by) for e in on_h200.values())


def test_training_is_planned_by_the_positions_its_steps_compute() -> None:
    """Every step is a row of train.batch_tokens, an epoch's last row padded, and the trainer computes each
    position of it: a corpus that fills a quarter of a row costs a whole row per epoch."""
    small = ["generate.datasets.0.num_samples=6", "train.epochs=3"]
    plan = make_plan(load_config("smollm2-local", small), "cpu", fixed=False)
    train, batch = plan.stage("train"), plan.cfg.train.batch_tokens
    assert train is not None and plan.sizes.train_tokens < 3 * batch / 2
    assert f"3 steps of {batch:,}-token rows compute {3 * batch:,} positions" in " ".join(train.assumptions)
    # Twice the row with the same tokens: every step costs twice as much.
    wide = make_plan(
        load_config("smollm2-local", [*small, f"train.batch_tokens={2 * batch}"]), "cpu", fixed=False
    )
    assert wide.stage("train").seconds == pytest.approx(2 * train.seconds)  # type: ignore[union-attr]
    # Twice the epochs: twice the steps.
    longer = make_plan(load_config("smollm2-local", [*small[:1], "train.epochs=6"]), "cpu", fixed=False)
    assert longer.stage("train").seconds == pytest.approx(2 * train.seconds)  # type: ignore[union-attr]


def test_the_held_out_prompts_are_the_eval_split_up_to_their_limit() -> None:
    """The evaluator draws its held-out prompts from the corpus's eval split: a corpus with fewer eval
    records than `evaluate.heldout_samples` evaluates fewer prompts, and the plan counts those."""
    small = ["generate.datasets.0.num_samples=6"]

    def evaluate_s(*more: str) -> float:
        plan = make_plan(load_config("smollm2-local", [*small, *more]), "cpu", fixed=False)
        return plan.stage("evaluate").seconds  # type: ignore[union-attr]

    plan = make_plan(load_config("smollm2-local", small), "cpu", fixed=False)
    held, mtbench = plan.sizes.eval_records, plan.cfg.evaluate.mtbench_questions
    assert mtbench and 0 < held < plan.cfg.evaluate.heldout_samples
    assert evaluate_s() == pytest.approx(
        evaluate_s("evaluate.heldout_samples=0") * (mtbench + held) / mtbench
    )
    assert evaluate_s("evaluate.heldout_samples=400") == pytest.approx(
        evaluate_s()
    )  # the split is all there is


def test_a_cpu_plan_says_how_far_this_machine_is_from_the_calibrated_one(monkeypatch, caplog) -> None:
    """A CPU plan measures this machine's multiply rate and sets it beside the calibration machine's;
    more than 25% apart, the table, the record and the pipeline's log say to recalibrate, unless the
    reading was slow while other work used the cores: then they say to plan again when they are idle."""
    from aerie.plan import machine, track

    calibrated = calibration_entries()["cpu"]["calibration_gemm_gflops"]["value"]
    assert machine.gemm_gflops() > 0 and 0 <= machine.others_share() <= 1  # the real probe, on this machine
    cfg = load_config("smollm2-local", [])
    monkeypatch.setattr(machine, "others_share", lambda: 0.1)  # idle, whatever the suite runs beside it
    monkeypatch.setattr(machine, "gemm_gflops", lambda: calibrated * 1.1)
    near = make_plan(cfg, "cpu")
    assert near.machine is not None and not near.machine.far
    assert "machine: fp32 matrix multiply" in table(near) and "recalibrate" not in table(near)
    monkeypatch.setattr(machine, "gemm_gflops", lambda: calibrated / 2)
    far = make_plan(cfg, "cpu")
    assert far.machine is not None and far.machine.far
    assert far.record()["machine"]["ratio"] == pytest.approx(0.5)
    assert "WARNING machine:" in table(far) and "recalibrate on this machine" in table(far)
    assert track.plan_for(cfg) is not None
    assert "recalibrate on this machine" in caplog.text
    monkeypatch.setattr(machine, "others_share", lambda: 0.6)
    busy = make_plan(cfg, "cpu")
    assert busy.machine is not None and busy.machine.far and busy.record()["machine"]["others_share"] == 0.6
    assert "other work used 60% of the cores" in table(busy) and "plan again when they are idle" in table(
        busy
    )
    monkeypatch.setattr(machine, "gemm_gflops", lambda: calibrated * 2)  # fast is never the load's doing
    assert "recalibrate on this machine (benchmarks" in table(make_plan(cfg, "cpu"))
    assert make_plan(load_config("smollm2-gpu", []), "h200").machine is None  # a GPU host is not here
