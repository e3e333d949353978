"""Deployment: the SGLang speculative launch it builds, the promotion decision, and the whole stage
against two real reference servers (baseline and speculative mode with an exported drafter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aerie.deploy import work
from aerie.deploy.config import DeployConfig
from aerie.deploy.work import decide_promotion, key_of, promote, server_specs
from aerie.errors import ConfigError, EvaluationError
from aerie.manifest import StageDir, load_manifest
from aerie.serving import ServerConfig
from aerie.store import LocalStore
from tests.conftest import free_port
from tests.evaluate_support import train_result
from tests.stage_work import staged

deploy = staged("deploy", work.deploy)
REPO = Path(__file__).resolve().parent.parent


def _argv_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_sglang_speculative_launch_command(tmp_path, smollm2):
    drafter_dir = tmp_path / "drafter"
    drafter_dir.mkdir()
    server = ServerConfig(backend="sglang", launcher="docker", port=30123, image="lmsysorg/sglang:v0.5.23")
    specs = server_specs(DeployConfig(num_steps=7), server, smollm2, str(drafter_dir))
    spec, base = specs["speculative"].command, specs["baseline"].command
    assert spec[:3] == ["python3", "-m", "sglang.launch_server"]
    assert _argv_value(spec, "--model-path") == smollm2.path
    assert _argv_value(spec, "--speculative-algorithm") == "EAGLE3"
    assert _argv_value(spec, "--speculative-draft-model-path") == str(drafter_dir.resolve())
    assert _argv_value(spec, "--speculative-num-steps") == "7"
    assert _argv_value(spec, "--speculative-eagle-topk") == "1"
    assert _argv_value(spec, "--speculative-num-draft-tokens") == "8"  # a chain: steps + 1
    assert _argv_value(spec, "--host") == "0.0.0.0"  # reachable through the published port
    assert not any(a.startswith("--speculative") for a in base)
    # Same server otherwise: the baseline differs only by the speculative flags (and its nonce).
    strip = {"--weight-version"}

    def plain(argv: list[str]) -> list[str]:
        flags = [i for i, a in enumerate(argv) if a.startswith("--speculative")]
        dropped = {j for i in flags for j in (i, i + 1)}
        kept = [a for i, a in enumerate(argv) if i not in dropped]
        return [a for i, a in enumerate(kept) if i == 0 or kept[i - 1] not in strip]

    assert plain(base) == plain(spec)
    # The drafter directory is mounted read-only at the same path inside the container.
    inside = specs["speculative"]
    assert inside.volumes[str(drafter_dir.resolve())] == str(drafter_dir.resolve())
    assert str(drafter_dir.resolve()) in inside.read_only_volumes
    assert inside.image == "lmsysorg/sglang:v0.5.23"


def test_sglang_serves_a_float32_target_in_its_drafters_dtype(tmp_path, smollm2):
    # SGLang serves a float32 checkpoint (the embedded SmolLM2) in float16 under --dtype auto; the
    # EAGLE-3 head's bfloat16 weights then meet float16 hidden states and the server dies.
    assert json.loads((Path(smollm2.path) / "config.json").read_text())["dtype"] == "float32"
    drafter_dir = tmp_path / "drafter"
    drafter_dir.mkdir()
    (drafter_dir / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    server = ServerConfig(backend="sglang", python="/usr/bin/python3", port=30124)
    specs = server_specs(DeployConfig(), server, smollm2, str(drafter_dir))
    for spec in specs.values():  # both, so the speed-up compares like with like
        assert _argv_value(spec.command, "--dtype") == "bfloat16"
    given = server.model_copy(update={"extra_args": ["--dtype", "float16"]})
    for spec in server_specs(DeployConfig(), given, smollm2, str(drafter_dir)).values():
        assert spec.command.count("--dtype") == 1 and _argv_value(spec.command, "--dtype") == "float16"
    # A target already in the drafter's dtype is served as SGLang chooses.
    (drafter_dir / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    assert all(
        "--dtype" not in s.command
        for s in server_specs(DeployConfig(), server, smollm2, str(drafter_dir)).values()
    )


def test_explicit_draft_tokens_and_tree_drafts(tmp_path, smollm2):
    server = ServerConfig(backend="sglang", port=30124)
    cfg = DeployConfig(num_steps=5, eagle_topk=4, num_draft_tokens=8)
    spec = server_specs(cfg, server, smollm2, str(tmp_path))["speculative"].command
    assert (
        _argv_value(spec, "--speculative-eagle-topk"),
        _argv_value(spec, "--speculative-num-draft-tokens"),
    ) == ("4", "8")
    with pytest.raises(EvaluationError, match="chains only"):
        server_specs(cfg, ServerConfig(backend="reference"), smollm2, str(tmp_path))
    with pytest.raises(ValueError, match="num_draft_tokens 6 contradicts"):
        DeployConfig(num_steps=3, num_draft_tokens=6)
    with pytest.raises(ValueError, match="promote_concurrency 4 is not one of"):
        DeployConfig(concurrency=[1, 8], promote_concurrency=4)
    with pytest.raises(ConfigError, match="docker runs SGLang"):
        server_specs(
            DeployConfig(), ServerConfig(backend="reference", launcher="docker"), smollm2, str(tmp_path)
        )


def _rows(base: dict[int, float], spec: dict[int, float]) -> list[dict]:
    return [{"server": "baseline", "concurrency": c, "output_tokens_per_s": v} for c, v in base.items()] + [
        {"server": "speculative", "concurrency": c, "output_tokens_per_s": v} for c, v in spec.items()
    ]


def test_promotion_decision():
    rows = _rows({1: 100.0, 8: 600.0}, {1: 180.0, 8: 500.0})
    yes = decide_promotion(rows, DeployConfig(concurrency=[1, 8], promote_margin=1.5))
    assert (yes.promoted, yes.concurrency, yes.speedup) == (True, 1, 1.8)
    assert "1.800x at concurrency 1 >= the margin 1.500x" in yes.reason
    no = decide_promotion(rows, DeployConfig(concurrency=[1, 8], promote_margin=2.0))
    assert not no.promoted and "<" in no.reason
    # Deciding at batch 8, where the baseline's batching wins.
    at8 = decide_promotion(rows, DeployConfig(concurrency=[1, 8], promote_concurrency=8, promote_margin=1.0))
    assert not at8.promoted and at8.speedup == pytest.approx(500 / 600, abs=1e-4)
    # A level measured for one server only never promotes.
    partial = decide_promotion(_rows({1: 100.0}, {}), DeployConfig(concurrency=[1, 8]))
    assert not partial.promoted and "no measurement of both servers" in partial.reason
    zero = decide_promotion(_rows({1: 0.0}, {1: 5.0}), DeployConfig(concurrency=[1]))
    assert not zero.promoted


@pytest.mark.integration
def test_deploy_benchmarks_two_real_reference_servers_and_promotes(tmp_path, smollm2):
    """Baseline and speculative reference servers (untrained drafter) on the same prompts: both serve
    the same greedy tokens, the speculative one reports its acceptance, and a margin it meets promotes
    the drafter to `<run>/promoted/`."""
    store = LocalStore(tmp_path / "store")
    drafter = train_result(store, "r", smollm2, tmp_path)
    evaluation = StageDir(store, "r", "evaluate", "e")
    store.put_bytes(evaluation.path("report.md"), b"# evaluation\n")
    evaluation_result = evaluation.finish({"figures": {}})
    cfg = DeployConfig(
        concurrency=[1, 2],
        num_prompts=2,
        max_new_tokens=6,
        num_steps=2,
        warmup_requests=1,
        promote_margin=0.01,
        expected_concurrency=2,
        # Steady state kept short on a CPU: a window of 0.2 s and one request per slot inside it, twice.
        level_seconds=0.2,
        requests_per_slot=1,
        repeats=2,
    )
    server = ServerConfig(port=free_port(), device="cpu", startup_timeout_s=300, grace_s=10)
    seen: list[float] = []
    result = deploy(
        cfg,
        store=store,
        run_name="r",
        target=smollm2,
        drafter=drafter,
        evaluation=evaluation_result,
        server=server,
        progress=lambda f, m: seen.append(f),
    )
    report = json.loads(store.get_bytes(f"{result.prefix}/report.json"))
    rows = {(r["server"], r["concurrency"]): r for r in report["rows"]}
    assert set(rows) == {(s, c) for s in ("baseline", "speculative") for c in (1, 2)}
    for (name, _), row in rows.items():
        assert row["requests"] >= 2 and row["output_tokens"] > 0 and row["output_tokens_per_s"] > 0
        assert row["repeats"] == 2 and len(row["tokens_per_s_runs"]) == 2 and row["spread"] >= 0
        assert row["window_s"] >= cfg.level_seconds and row["requests_per_slot"] >= 1
        assert row["ttft_p50_s"] > 0 and row["latency_p50_s"] >= row["ttft_p50_s"] * 0.5
        if name == "speculative":
            assert 1.0 <= row["accept_length"] <= cfg.num_steps + 1 + 1  # (+1: the prefill token)
        else:
            assert row["accept_length"] is None
    # Speculative decoding is lossless: the same tokens from both servers, prompt by prompt.
    assert report["same_outputs"] == {"compared": 4, "identical": 4}
    # The reference server speaks EAGLE-3 only: n-gram speculation is not served, and the report says so.
    assert "ngram" not in report["servers"] and "measured on SGLang" in report["ngram"]
    assert report["promotion"]["concurrency"] == 2  # decided at the user's expected concurrency
    assert report["recommendation"]["concurrency"] == 2
    prediction = json.loads(store.get_bytes(f"{result.prefix}/prediction.json"))
    assert prediction["predicted"] is None and "CPU" in prediction["why_not_predicted"]
    assert "--speculative-algorithm EAGLE3" in report["servers"]["speculative"]["command"]
    assert report["promotion"]["promoted"]
    md = store.get_bytes(f"{result.prefix}/report.md").decode()
    assert "| speculative | 1 |" in md and "**Promotion: promoted**" in md
    promoted = json.loads(store.get_bytes("r/promoted/promotion.json"))
    assert promoted["drafter"] == f"{drafter.prefix}/drafter"
    assert store.get_bytes("r/promoted/drafter/model.safetensors") == store.get_bytes(
        f"{drafter.prefix}/drafter/model.safetensors"
    )
    assert store.exists("r/promoted/report.md") and store.exists("r/promoted/evaluation-report.md")
    serving = json.loads(store.get_bytes("r/promoted/serving.json"))
    assert serving["expected_concurrency"] == 2 and serving["deployed_num_steps"] == 2
    tiers = {t["concurrency"]: t for t in serving["tiers"]}
    assert set(tiers) == {1, 2}
    for c, tier in tiers.items():
        assert tier["measured_speedup"] == rows[("speculative", c)]["speedup"]
        assert tier["measured_accept_length"] == rows[("speculative", c)]["accept_length"]
        # No prediction on a CPU: the measured serve recommends the deployed chain where it paid there.
        if rows[("speculative", c)]["speedup"] > 1.0:
            assert (
                tier["num_steps"] == 2
                and tier["launch_args"][tier["launch_args"].index("--speculative-num-steps") + 1] == "2"
            )
        else:
            assert tier["num_steps"] is None and tier["launch_args"] == []
    assert serving["recommendation"]["server"] in {"baseline", "speculative"}
    # The served record is written from the deploy stage's report: one entry per level.
    out = tmp_path / "served-cpu.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "planner" / "served.py"), "record", "--report",
         str(Path(store.root) / result.prefix / "report.json"), "--card", "cpu", "--machine", "this CPU",
         "--command", "test_deploy", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    served = json.loads(out.read_text())
    assert [lvl["concurrency"] for lvl in served["levels"]] == [1, 2]
    for lvl in served["levels"]:
        c = lvl["concurrency"]
        assert lvl["measured_speedup"] == pytest.approx(rows[("speculative", c)]["speedup"], abs=1e-3)
        assert lvl["predicted_speedup"] is None  # served on a CPU: no prediction, and the record says so
        assert lvl["served_accept_length"] == rows[("speculative", c)]["accept_length"]
        assert set(lvl["spread"]) == {"baseline", "speculative"}
    assert load_manifest(store, result.prefix)["figures"]["promoted"] is True
    assert seen[-1] == 1.0


def test_a_run_without_offline_evaluation_still_keys_and_promotes(tmp_path, smollm2):
    """`evaluate.enabled: false` (a target no one GPU holds): deploy keys on the drafter alone and the
    promoted directory holds the drafter and the deployment report, with no evaluation pointer."""
    from aerie.pipeline import planned
    from aerie.presets import load_config

    assert "evaluate" not in [s.name for s in planned(load_config("kimi-k2.5-8gpu", []))]
    store = LocalStore(tmp_path / "store")
    drafter = train_result(store, "r", smollm2, tmp_path)
    evaluation = StageDir(store, "r", "evaluate", "e").finish({"figures": {}})
    cfg, server = DeployConfig(), ServerConfig()
    assert key_of(cfg, server, smollm2, drafter, None) != key_of(cfg, server, smollm2, drafter, evaluation)
    report = {"promotion": {"speedup": 1.2, "concurrency": 1}}
    prefix = promote(store, "r", drafter, None, report, "# deployment\n")
    assert json.loads(store.get_bytes(f"{prefix}/promotion.json"))["evaluation"] is None
    assert store.exists(f"{prefix}/drafter/model.safetensors") and store.exists(f"{prefix}/report.md")
    assert not store.exists(f"{prefix}/evaluation-report.md")


def _sglang_unavailable() -> str | None:
    """Why the SGLang deployment cannot run here (None when it can): it needs a Docker engine, a GPU
    and the SGLang image."""
    import torch

    from aerie.errors import ServerLaunchError
    from aerie.serving.container import docker_client

    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        docker_client()
    except ServerLaunchError as exc:
        return str(exc)
    return None


@pytest.mark.docker
@pytest.mark.gpu
def test_deploy_with_sglang_in_docker(tmp_path, smollm2):
    """The production path: SGLang in Docker serving the exported drafter with EAGLE3 (skipped without
    an engine and a GPU; the image is AERIE_SGLANG_IMAGE, default lmsysorg/sglang:latest)."""
    import os

    reason = _sglang_unavailable()
    if reason is not None:
        pytest.skip(f"needs Docker, a GPU and the SGLang image: {reason}")
    store = LocalStore(tmp_path / "store")
    drafter = train_result(store, "r", smollm2, tmp_path)
    evaluation = StageDir(store, "r", "evaluate", "e").finish({"figures": {}})
    server = ServerConfig(
        backend="sglang",
        launcher="docker",
        image=os.environ.get("AERIE_SGLANG_IMAGE", "lmsysorg/sglang:latest"),
        port=free_port(),
        device="cuda",
        startup_timeout_s=1200,
        hf_cache=None,
        sglang_serve_module="sglang.launch_server",
    )
    cfg = DeployConfig(concurrency=[1], num_prompts=4, max_new_tokens=32, num_steps=3, promote_margin=100.0)
    result = deploy(
        cfg, store=store, run_name="r", target=smollm2, drafter=drafter, evaluation=evaluation, server=server
    )
    report = json.loads(store.get_bytes(f"{result.prefix}/report.json"))
    spec_row = next(r for r in report["rows"] if r["server"] == "speculative")
    assert spec_row["accept_length"] is not None and spec_row["accept_length"] >= 1.0
    assert not report["promotion"]["promoted"]  # a margin of 100x is never met
    assert not store.exists("r/promoted/promotion.json")


def test_num_steps_is_bounded_and_expected_concurrency_decides_promotion():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="num_steps"):
        DeployConfig(num_steps=15)
    # The user's traffic joins the benchmarked levels and decides: the drafter pays at 1, not at 8.
    cfg = DeployConfig(concurrency=[1], expected_concurrency=8, promote_margin=1.0)
    assert cfg.concurrency == [1, 8] and cfg.deciding_concurrency == 8
    rows = _rows({1: 100.0, 8: 600.0}, {1: 180.0, 8: 500.0})
    assert not decide_promotion(rows, cfg).promoted
    assert decide_promotion(rows, DeployConfig(concurrency=[1, 8], expected_concurrency=1)).promoted
    with pytest.raises(ValidationError, match="disagree"):
        DeployConfig(concurrency=[1, 8], expected_concurrency=8, promote_concurrency=1)


def test_ngram_faster_than_the_drafter_blocks_promotion_and_is_recommended():
    from aerie.deploy.work import recommend

    rows = _rows({1: 100.0}, {1: 150.0}) + [
        {"server": "ngram", "concurrency": 1, "output_tokens_per_s": 170.0}
    ]
    decision = decide_promotion(rows, DeployConfig(concurrency=[1]))
    assert not decision.promoted and "n-gram" in decision.reason
    assert recommend(rows, 1)["server"] == "ngram"


def test_sglang_launches_serve_ngram_and_room_for_the_highest_level(tmp_path, smollm2):
    drafter_dir = tmp_path / "drafter"
    drafter_dir.mkdir()
    server = ServerConfig(backend="sglang", port=30125)
    specs = server_specs(DeployConfig(concurrency=[1, 64]), server, smollm2, str(drafter_dir))
    assert set(specs) == {"baseline", "speculative", "ngram"}
    ngram = specs["ngram"].command
    assert _argv_value(ngram, "--speculative-algorithm") == "NGRAM"
    assert "--speculative-draft-model-path" not in ngram
    for spec in specs.values():  # SGLang caps speculative servers at 48 running requests otherwise
        assert _argv_value(spec.command, "--max-running-requests") == "64"
    assert "ngram" not in server_specs(DeployConfig(ngram="off"), server, smollm2, str(drafter_dir))
    with pytest.raises(EvaluationError, match="n-gram"):
        server_specs(DeployConfig(ngram="on"), ServerConfig(port=30126), smollm2, str(drafter_dir))


def test_serving_plan_recommends_per_tier_the_k_the_fit_favours_and_refuses_unmeasured_tiers(monkeypatch):
    """The prediction half of serving.json on a GPU card, from a small table of the data file's form
    (figures chosen for easy arithmetic). The card is a stand-in: no GPU here to name one."""
    from types import SimpleNamespace

    from aerie.deploy.serving_plan import serving_plan, with_measured
    from aerie.plan import served

    def level(step: float, a: float, b: float) -> dict:
        return {"step_ms": step, "round_ms": {str(k): a + b * k for k in (1, 3, 5, 7)}}

    table = {
        "cards": {
            "x100": {
                "source": "spec_cost-x100.json",
                "shapes": {
                    "s": {
                        "active_params": 1e8,
                        "moe": False,
                        "levels": {"1": level(2.0, 2.0, 0.3), "8": level(2.0, 3.0, 0.6)},
                    }
                },
            }
        }
    }
    monkeypatch.setattr(served, "_table", lambda: table)
    monkeypatch.setattr(served, "this_card", lambda: "x100")
    target = SimpleNamespace(name="t", architecture="LlamaForCausalLM", size_bytes=2e8)
    figures = {f"accept_mtbench_eagle3_k{k}": 1.0 + 0.5 * k for k in (1, 3, 5, 7)}
    cfg = DeployConfig(concurrency=[1, 8, 64], num_steps=3)
    plan = serving_plan(cfg, ServerConfig(backend="sglang"), target, figures, "EAGLE3")
    tiers = {t["concurrency"]: t for t in plan["tiers"]}
    for c in (1, 8):
        best = max(
            (1, 3, 5, 7),
            key=lambda k: (
                plan["accept_length"][str(k)]["served"] / plan["break_even_accept_length"][str(k)][str(c)]
            ),
        )
        speedup = (
            plan["accept_length"][str(best)]["served"] / plan["break_even_accept_length"][str(best)][str(c)]
        )
        if speedup > 1.0:
            assert tiers[c]["num_steps"] == best and f"{best + 1}" in tiers[c]["launch_args"]
        else:
            assert tiers[c]["num_steps"] is None and tiers[c]["launch_args"] == []
        assert tiers[c]["predicted_speedup"] == pytest.approx(speedup, abs=2e-3)
    # c64 lies outside the measured levels: nothing predicted, nothing recommended, and why.
    assert tiers[64]["predicted_speedup"] is None and tiers[64]["launch_args"] is None
    assert "concurrency 64 outside the measured 1-8" in tiers[64]["why"]
    # The serve then fills the unpredicted tier from what it measured.
    report = {
        "num_steps": 3,
        "rows": [{"server": "speculative", "concurrency": 64, "speedup": 1.3, "accept_length": 2.0}],
    }
    measured = {t["concurrency"]: t for t in with_measured(plan, report)["tiers"]}
    assert measured[64]["num_steps"] == 3 and measured[64]["measured_speedup"] == 1.3
    assert "measured at k=3" in measured[64]["why"]
    # Another family's drafter is launched under its own algorithm, without EAGLE-3's chain flags.
    dflash = serving_plan(cfg, ServerConfig(backend="sglang"), target, figures, "DFLASH")
    args = next(t["launch_args"] for t in dflash["tiers"] if t["launch_args"])
    assert args[:2] == ["--speculative-algorithm", "DFLASH"] and "--speculative-eagle-topk" not in args


def test_benchmark_summary_figures():
    from aerie.deploy.bench import RequestRecord, summarize

    records = [
        RequestRecord(0, 1.0, 11, 4, [], ttft_s=0.5, itl_s=[0.05] * 10),
        RequestRecord(1, 3.0, 21, 6, [], ttft_s=1.0, itl_s=[0.1] * 20),
    ]
    level = summarize("speculative", 2, records, wall_s=4.0)
    assert level.output_tokens == 32 and level.output_tokens_per_s == 8.0
    assert level.accept_length == 32 / 10  # Σ completion / Σ verify, as SpecForge's benchmark
    assert level.itl_p50_s == pytest.approx(0.1) and level.itl_p99_s == pytest.approx(0.1)  # per token
    assert level.ttft_p50_s == pytest.approx(0.75)
    # A server that reports no spec_verify_ct has no acceptance length.
    plain = [RequestRecord(0, 1.0, 5, None, [], 0.2), RequestRecord(1, 1.0, 5, None, [], 0.2)]
    assert summarize("baseline", 1, plain, 2.0).accept_length is None


def test_each_level_is_timed_after_an_untimed_pass_of_its_own_workload(monkeypatch):
    """The warm-up's order: its requests one after another, then per level the level's whole workload
    untimed before the timed pass (a server compiling kernels per batch shape compiles them there).
    The requests themselves are the two-server test's; here `_level` only records what it is asked."""
    import asyncio

    from aerie.deploy import bench

    asked: list[tuple[int, int, int]] = []

    async def level(client, prompts, concurrency, max_new_tokens):
        asked.append((len(prompts), concurrency, max_new_tokens))
        return [bench.RequestRecord(i, 1.0, 2, None, [], 0.1) for i in range(len(prompts))], 1.0

    monkeypatch.setattr(bench, "_level", level)
    prompts = [[1, 2, 3]] * 5
    results, _ = asyncio.run(bench.benchmark_async("http://127.0.0.1:9", "b", prompts, [1, 4], 16, warmup=2))
    assert asked == [(2, 1, 8), (5, 1, 16), (5, 1, 16), (5, 4, 16), (5, 4, 16)]
    assert [r.concurrency for r in results] == [1, 4]
    asked.clear()
    asyncio.run(bench.benchmark_async("http://127.0.0.1:9", "b", prompts, [1, 4], 16, warmup=0))
    assert asked == [(5, 1, 16), (5, 4, 16)]  # no warm-up at all


def test_streamed_chunks_time_each_token():
    """A chunk's gap is shared by the tokens it brings (a speculative step brings several); the ids
    add up whether the server sends them whole or only the new ones."""
    from aerie.deploy.bench import _Stream

    whole, new_only = _Stream(0, started=10.0), _Stream(0, started=10.0)
    for now, ids, count, verify in [(10.5, [7], 1, 0), (10.7, [7, 8, 9], 3, 1), (11.0, [7, 8, 9, 4], 4, 2)]:
        meta = {"completion_tokens": count, "spec_verify_ct": verify}
        whole.add({"output_ids": ids, "meta_info": meta}, now)
        new_only.add({"output_ids": ids[len(new_only.output_ids) :], "meta_info": meta}, now)
    for stream in (whole, new_only):
        record = stream.record(latency_s=1.0)
        assert record.output_ids == [7, 8, 9, 4] and record.completion_tokens == 4
        assert record.ttft_s == pytest.approx(0.5) and record.spec_verify_ct == 2
        assert record.itl_s == pytest.approx([0.1, 0.1, 0.3])
