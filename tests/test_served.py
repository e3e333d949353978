"""The served speed-up model (aerie/plan/served.py): its arithmetic on a small table, its table against the
benchmark records it was folded from, and its lines in `aerie plan` and the deploy stage."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from aerie.errors import ConfigError
from aerie.plan import served

REPO = Path(__file__).resolve().parent.parent


def shape(active_params: float, levels: dict[int, tuple[float, dict[int, float]]], moe: bool = False) -> dict:
    """One shape of the data file's form: `levels` maps a concurrency to (step ms, {draft steps: round ms})."""
    return {
        "active_params": active_params,
        "moe": moe,
        "levels": {
            str(c): {"step_ms": step, "round_ms": {str(k): ms for k, ms in rounds.items()}}
            for c, (step, rounds) in levels.items()
        },
    }


# A table of the data file's form, its figures chosen for easy arithmetic (not measurements).
TABLE = {
    "cards": {
        "x100": {
            "source": "spec_cost-x100.json",
            "shapes": {
                "small": shape(1e8, {1: (2.0, {3: 5.0, 7: 9.0}), 8: (2.0, {3: 6.0, 7: 10.0})}),
                "large": shape(1e10, {1: (8.0, {3: 12.0, 7: 20.0}), 8: (8.0, {3: 16.0, 7: 24.0})}),
                "experts": shape(3e9, {1: (10.0, {3: 15.0, 7: 25.0})}, moe=True),
            },
        }
    }
}


def est(params: float, k: int = 3, levels: list[int] | None = None, moe: bool = False, **kw):
    return served.estimate(served.Shape("t", params, moe), "x100", k, levels or [1, 8], table=TABLE, **kw)


def test_measured_shape_gives_its_own_times_and_the_speedup_formula():
    e = est(1e8, accept_length=2.5)
    c1, c8 = e.predictions
    assert (c1.step_ms, c1.round_ms) == (2.0, 5.0)
    assert c1.break_even == pytest.approx(2.5)
    assert c1.speedup == pytest.approx(1.0)  # accept length = break-even: no gain
    assert c8.break_even == pytest.approx(3.0)
    assert c8.speedup == pytest.approx(2.5 / 3.0)
    assert "the measured small shape" in e.basis


def test_between_shapes_interpolates_in_log_params_and_log_time():
    mid = est(1e9).predictions[0]  # halfway in log(params) between 1e8 and 1e10
    assert mid.step_ms == pytest.approx(math.sqrt(2.0 * 8.0))
    assert mid.round_ms == pytest.approx(math.sqrt(5.0 * 12.0))
    assert "between the measured small and large" in est(1e9).basis


def test_outside_the_measured_range_takes_the_nearest_shape():
    assert est(1e7).predictions[0].step_ms == 2.0
    assert est(1e12).predictions[0].round_ms == 12.0
    assert "nearest measured shape large" in est(1e12).basis


def test_moe_targets_use_the_measured_moe():
    p = est(2e10, moe=True, levels=[1]).predictions[0]
    assert (p.step_ms, p.round_ms) == (10.0, 15.0)


def test_step_counts_between_the_measured_ones_are_fitted_and_flagged_outside_refused():
    inside = est(1e8, k=5, accept_length=2.0).predictions[0]
    assert inside.round_ms == pytest.approx(7.0) and inside.speedup is not None
    assert any("k=5 fitted" in f for f in inside.flags) and "NOT MEASURED" in inside.text()
    for k in (1, 8, 15):  # no extrapolation in k: the speed-up is refused, with the reason
        out = est(1e8, k=k, accept_length=min(2.0, k + 1.0)).predictions[0]
        assert out.speedup is None and f"k={k} outside the measured 3-7" in (out.refused or "")
        assert "no speed-up predicted" in out.text()
    assert est(1e8, k=7, accept_length=2.0).predictions[0].flags == ()


def test_concurrency_between_levels_interpolates_and_outside_is_refused():
    e = est(1e10, levels=[1, 8, 64, 3], accept_length=2.0)
    by = {p.concurrency: p for p in e.predictions}
    assert by[64].speedup is None and "concurrency 64 outside the measured 1-8" in (by[64].refused or "")
    assert 12.0 < by[3].round_ms < 16.0 and by[3].speedup is not None
    assert any("concurrency 3 interpolated" in f for f in by[3].flags)
    assert "c64: no speed-up predicted" in "\n".join(e.lines())


# The record's own pathology, made worse: at c1 the 3-step round timed slower than the 7-step one, and
# the c8 step timed faster than the c1 step. Figures chosen to show it, not measurements.
NOISY_LEVELS = {
    "1": {
        "step_ms": 1.4,
        "step_ms_reps": [1.4, 1.5, 1.3],
        "round_ms": {"3": 5.4, "5": 4.0, "7": 3.5},
        "round_ms_reps": {"3": [5.4, 5.6, 5.2], "5": [4.0, 4.1], "7": [3.5, 3.4, 3.6]},
    },
    "8": {"step_ms": 1.2, "round_ms": {"3": 2.9, "5": 3.1, "7": 3.2}},
    "32": {"step_ms": 2.7, "round_ms": {"3": 3.5, "5": 3.6, "7": 3.6}},
}
NOISY = {
    "cards": {
        "x100": {
            "source": "spec_cost-x100.json",
            "shapes": {"s": {"active_params": 1e8, "moe": False, "levels": NOISY_LEVELS}},
        }
    }
}


def test_the_fit_is_monotone_in_steps_and_concurrency_whatever_the_noise():
    fits = served.fit_shape(NOISY_LEVELS)
    assert all(f.a >= 0 and f.b >= 0 for f in fits)
    assert [f.step_ms for f in fits] == sorted(f.step_ms for f in fits)
    levels = (1, 2, 8, 16, 32)
    grid = {
        (k, c): served.estimate(served.Shape("s", 1e8, False), "x100", k, [c], table=NOISY).predictions[0]
        for k in range(3, 8)
        for c in levels
    }
    for (k, c), p in grid.items():
        if k > 3:
            assert p.round_ms >= grid[(k - 1, c)].round_ms
        if c > 1:
            previous = max(x for x in levels if x < c)
            assert p.round_ms >= grid[(k, previous)].round_ms and p.step_ms >= grid[(k, previous)].step_ms
    # The repetitions give the spread, and the speed-up an interval around it.
    c1 = served.estimate(served.Shape("s", 1e8, False), "x100", 3, [1], 3.0, table=NOISY).predictions[0]
    assert c1.round_sd_ms > 0 and c1.step_sd_ms > 0
    low, high = c1.speedup_range or (0.0, 0.0)
    assert low < (c1.speedup or 0.0) < high


def test_an_unmeasured_shape_and_card_are_flagged_in_the_plan(monkeypatch):
    e = served.estimate(served.Shape("t", 1e12, False), "h999", 3, [1], 2.0, table=TABLE)
    assert any("the shape itself (1e+03B active)" in f for f in e.flags) and any(
        "card h999" in f for f in e.flags
    )
    assert sum("NOT MEASURED" in line for line in e.lines()) == len(e.flags)
    monkeypatch.setattr(served, "_table", lambda: TABLE)
    facts = SimpleNamespace(name="t", active_params=1e12, weight_bytes=2e12)
    plan = served.for_plan(facts, "h999", True, 3, [1, 64])
    assert any("c64: no speed-up predicted" in line for line in plan)
    rows = [line for line in plan if "speed-up at accept length" in line]
    assert rows and all("NOT MEASURED" in line for line in rows)
    # A measured shape served over several GPUs: every shape was timed on one.
    measured = SimpleNamespace(name="t", active_params=1e8, weight_bytes=2e8)
    assert not any("NOT MEASURED" in line for line in served.for_plan(measured, "x100", True, 3, [1]))
    tp = served.for_plan(measured, "x100", True, 3, [1], tp_size=8)
    assert "  NOT MEASURED: tensor parallel 8 (every shape measured on one GPU)" in tp


def test_per_level_accept_lengths():
    e = est(1e8, accept_length={1: 2.5, 8: 3.0})
    assert [p.speedup for p in e.predictions] == [pytest.approx(1.0), pytest.approx(1.0)]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"k": 0}, "num_steps 0"),
        ({"levels": [0]}, "concurrency"),
        ({"accept_length": 0.5}, "accept length 0.5"),
        ({"accept_length": 4.5}, "between 1 and 4"),
    ],
)
def test_bad_input_is_refused_with_what_and_where(kw, match):
    with pytest.raises(ConfigError, match=match):
        est(1e8, **kw)


def test_lines_name_the_card_the_basis_and_the_record():
    text = "\n".join(served.estimate(served.Shape("t", 1e8, False), "h999", 3, [1], 2.0, table=TABLE).lines())
    assert "measured on x100, for h999" in text
    assert "pays above 2.50 accepted tokens per round" in text
    assert "at 2.00: 0.80x" in text
    assert "benchmarks/results/spec_cost-x100.json" in text


def test_evaluated_accept_length_prefers_mtbench_greedy_at_the_served_steps():
    figures = {
        "accept_heldout_eagle3_k3": 1.7,
        "accept_mtbench_eagle3_k3": 1.6,
        "accept_mtbench_eagle3_k3_t1": 1.2,
        "accept_mtbench_prompt_lookup_k3": 1.1,
        "accept_mtbench_eagle3_k7": 1.9,
    }
    assert served.evaluated_accept_length(figures, 3) == (1.6, "accept_mtbench_eagle3_k3")
    assert served.evaluated_accept_length({"accept_heldout_eagle3_k7": 2.0}, 7) == (
        2.0,
        "accept_heldout_eagle3_k7",
    )
    assert served.evaluated_accept_length(figures, 5) is None


def test_moe_is_recognised_by_architecture_or_by_weights_far_above_active_params():
    info = SimpleNamespace(name="q", architecture="Qwen3MoeForCausalLM", size_bytes=6.1e10)
    assert served.shape_of_target(info).moe
    dense = SimpleNamespace(name="l", architecture="LlamaForCausalLM", size_bytes=1.6e10)
    assert served.shape_of_target(dense) == served.Shape("l", 8e9, False)
    facts = SimpleNamespace(name="k", active_params=3.2e10, weight_bytes=5.95e11)
    assert served.shape_of_target(facts).moe


def test_deploy_prediction_uses_the_evaluated_accept_length_and_lands_in_the_figures(monkeypatch):
    monkeypatch.setattr(served, "_table", lambda: TABLE)
    target = SimpleNamespace(name="t", architecture="LlamaForCausalLM", size_bytes=2e8)
    deploy = SimpleNamespace(num_steps=3, concurrency=[1, 8])
    evaluation = SimpleNamespace(figures={"accept_mtbench_eagle3_k3": 2.5, "accept_mtbench_eagle3_k7": 3.5})
    predicted = served.before_deploy(deploy, target, evaluation)
    # The offline 2.5 is mapped to the served accept length the records lead one to expect (lower).
    tau = served.served_accept_length(2.5)[0]
    assert predicted is not None and [p.accept_length for p in predicted.predictions] == [tau, tau]
    assert tau < 2.5 and f"c1 {tau / 2.5:.2f}x" in predicted.summary()
    result = SimpleNamespace(figures={"speedup": 0.9}, model_copy=lambda update: update["figures"])
    (figures,) = served.after_deploy(predicted, [result])
    assert figures == {
        "speedup": 0.9,
        "predicted_speedup_c1": round(tau / 2.5, 3),
        "predicted_speedup_c8": round(tau / 3.0, 3),
    }
    bare = served.before_deploy(deploy, target, None)
    assert bare is not None and bare.predictions[0].speedup is None


def test_the_deploy_stage_predicts_through_the_stage_contract_and_not_on_a_cpu(monkeypatch, tmp_path):
    """The composer asks every stage for a prediction (`Stage.predict`) and hands it back with the
    results (`Stage.with_prediction`): deploy's is the served speed-up, none for a CPU deployment."""
    from aerie.config import PipelineConfig
    from aerie.deploy.stage import DEPLOY
    from aerie.manifest import StageResult
    from aerie.stage import StageContext
    from aerie.store import LocalStore

    monkeypatch.setattr(served, "_table", lambda: TABLE)
    target = SimpleNamespace(name="t", architecture="LlamaForCausalLM", size_bytes=2e8)
    ctx = StageContext(store=LocalStore(tmp_path), run="r", target=target)  # type: ignore[arg-type]
    cfg = PipelineConfig(run="r")
    on = {
        device: cfg.model_copy(update={"server": cfg.server.model_copy(update={"device": device})})
        for device in ("cpu", "cuda")
    }
    assert DEPLOY.predict(DEPLOY.job(on["cpu"], ctx)) is None
    predicted = DEPLOY.predict(DEPLOY.job(on["cuda"], ctx))
    assert predicted == served.before_deploy(cfg.deploy, target, None) and predicted is not None
    result = StageResult(
        stage="deploy",
        key="k",
        prefix="r/deploy/k",
        manifest_uri="m",
        manifest_sha256="s",
        cache_hit=False,
        seconds=1.0,
        figures={"speedup": 0.9},
    )
    (with_it,) = DEPLOY.with_prediction(predicted, [result])
    assert set(with_it.figures) == {"speedup"} | {f"predicted_speedup_c{c}" for c in cfg.deploy.concurrency}
    assert DEPLOY.with_prediction(None, [result]) == [result]


def test_no_measurements_leave_the_plan_a_line_and_the_deploy_stage_no_prediction(monkeypatch):
    monkeypatch.setattr(served, "_table", lambda: {"cards": {}})
    facts = SimpleNamespace(name="t", active_params=1e8, weight_bytes=2e8)
    (line,) = served.for_plan(facts, "h200", True, 3, [1])
    assert "not predicted" in line and "benchmarks/planner/spec_cost.py" in line
    target = SimpleNamespace(name="t", architecture="LlamaForCausalLM", size_bytes=2e8)
    assert served.before_deploy(SimpleNamespace(num_steps=3, concurrency=[1]), target, None) is None


def test_a_target_with_a_geometry_is_sized_and_classed_by_it(smollm2):
    # The embedded target's checkpoint is float32: four bytes a parameter read as "weights far above the
    # active parameters" made it an MoE; its geometry says it routes no experts.
    facts = SimpleNamespace(name=smollm2.name, geometry=smollm2.geometry, weight_bytes=4.0 * 134_515_008)
    got = served.shape_of_target(facts)
    assert not got.moe and math.isclose(got.active_params, smollm2.geometry.params()[1])


def test_an_moe_target_without_a_measured_moe_says_it_takes_dense_times_and_the_check_is_printed():
    table = {"cards": {"x100": {**TABLE["cards"]["x100"], "check": "predicted 0.42x, measured 0.65x"}}}
    table["cards"]["x100"]["shapes"] = {
        k: v for k, v in TABLE["cards"]["x100"]["shapes"].items() if not v["moe"]
    }
    moe = served.estimate(served.Shape("t", 3e10, True), "x100", 3, [1], table=table)
    assert "no MoE shape measured" in moe.basis
    assert "  checked: predicted 0.42x, measured 0.65x" in moe.lines()
    dense = served.estimate(served.Shape("t", 3e10, False), "x100", 3, [1], table=table)
    assert "no MoE shape measured" not in dense.basis


def _served_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "served_benchmark", REPO / "benchmarks" / "planner" / "served.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_acceptance_map_on_record_is_the_one_the_records_give():
    import json

    script = _served_script()
    on_record = json.loads(served.ACCEPTANCE_MAP.read_text())
    pairs = script.acceptance_pairs()
    assert [p["offline"] for p in pairs] == [p["offline"] for p in on_record["pairs"]]
    xs = [p["offline"] - 1 for p in pairs]
    ys = [p["served"] - 1 for p in pairs]
    slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    assert on_record["slope"] == pytest.approx(slope, abs=1e-4)
    # Served acceptance runs below offline on every pair: the map lowers it, and says how well it fits.
    value, how = served.served_accept_length(2.5)
    assert 1.0 < value < 2.5 and "residual sd" in how and f"{on_record['pairs_used']} pairs" in how


def test_the_served_record_puts_prediction_beside_measurement_per_level():
    script = _served_script()
    rows = [
        {"server": "baseline", "concurrency": 1, "output_tokens_per_s": 100.0, "spread": 0.02},
        {"server": "speculative", "concurrency": 1, "output_tokens_per_s": 150.0, "accept_length": 2.1},
        {"server": "ngram", "concurrency": 1, "output_tokens_per_s": 120.0, "accept_length": 1.6},
        {"server": "baseline", "concurrency": 8, "output_tokens_per_s": 600.0},
        {"server": "speculative", "concurrency": 8, "output_tokens_per_s": 540.0, "accept_length": 2.0},
    ]
    prediction = {
        "tiers": [{"concurrency": 1, "predicted_speedup": 1.4}, {"concurrency": 8, "predicted_speedup": 1.2}]
    }
    c1, c8 = script.levels(prediction, rows)
    assert c1["measured_speedup"] == 1.5 and c1["ngram_speedup"] == 1.2 and c1["served_accept_length"] == 2.1
    assert c1["within_15_percent"] and c1["prediction_error"] == pytest.approx(1.4 / 1.5 - 1, abs=1e-4)
    assert c8["measured_speedup"] == 0.9 and not c8["within_15_percent"] and c8["ngram_speedup"] is None
