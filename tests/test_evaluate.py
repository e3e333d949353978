"""The evaluate stage end to end on the embedded target: real corpus, real exported drafter, report
files, cache hit, resume from finished parts, and a clear error for a train result without a drafter."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from aerie.datasets import load_mtbench
from aerie.engine.speculative.decoder import SpecDecoder
from aerie.errors import EvaluationError
from aerie.evaluate import work
from aerie.evaluate.config import EvaluateConfig
from aerie.evaluate.prompts import spread_over_categories
from aerie.families import family
from aerie.manifest import StageDir, load_manifest
from aerie.store import LocalStore
from tests.evaluate_support import corpus_result, train_result
from tests.stage_work import staged

# The drafters measured here are EAGLE-3 ones: the run's family, as the stage passes it.
run = partial(staged("evaluate", work.run), family=family("eagle3"))

CFG = EvaluateConfig(
    num_steps=[2, 3],
    max_new_tokens=8,
    mtbench_questions=2,
    heldout_samples=2,
    batch_size=2,
    device="cpu",
    temperatures=[0.0],
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def upstream(tmp_path_factory, smollm2):
    tmp = tmp_path_factory.mktemp("eval")
    store = LocalStore(tmp / "store")
    corpus = corpus_result(store, "r", smollm2)
    return store, corpus, train_result(store, "r", smollm2, tmp, corpus=corpus)


def test_evaluate_stage_reports_both_proposers_on_both_datasets(upstream, smollm2, monkeypatch):
    store, corpus, drafter = upstream
    seen: list[tuple[float, str]] = []
    result = run(
        CFG,
        store=store,
        run_name="r",
        target=smollm2,
        drafter=drafter,
        corpus=corpus,
        progress=lambda f, m: seen.append((f, m)),
    )
    report = json.loads(store.get_bytes(f"{result.prefix}/report.json"))
    combos = {(r["dataset"], r["proposer"], r["num_steps"]) for r in report["results"]}
    assert combos == {
        (d, p, k) for d in ("mtbench", "heldout") for p in ("eagle3", "prompt_lookup") for k in (2, 3)
    }
    for r in report["results"]:
        assert r["sequences"] == 2
        assert 1.0 <= r["accept_length"] <= r["num_steps"] + 1
        assert len(r["conditional_acceptance"]) == r["num_steps"]
        assert r["spec_verify_ct"] > 0
        if r["proposer"] == "eagle3":
            assert 0.0 <= r["draft_vocab_coverage"] <= 1.0
    # Every run decodes the same prompts and the decoder is lossless: same outputs everywhere.
    assert report["agreement"]["compared"] == 2 * 2 * (2 * 2 - 1)
    assert report["agreement"]["identical"] == report["agreement"]["compared"]
    md = store.get_bytes(f"{result.prefix}/report.md").decode()
    assert "## Acceptance length" in md and "| mtbench | eagle3 | 2 |" in md
    assert "pos 3" in md and "of the target's output tokens are in the draft vocabulary" in md
    assert "walked in rounds: 1.25 (per-position estimate 1.50" in md  # the train manifest's two figures
    # The teacher-forced replay of the eagle3 answers walks the same rounds as the decoder did.
    for name in ("mtbench", "heldout"):
        measured = next(
            r["accept_length"]
            for r in report["results"]
            if (r["dataset"], r["proposer"], r["num_steps"]) == (name, "eagle3", 3)
        )
        assert report["diagnosis"][name]["simulated_accept_length"] == pytest.approx(measured, abs=1e-3)
        # The answers' coverage by draft vocabs of other sizes: this drafter's size gives the decoder's own
        # figure, and coverage grows with the size up to the whole vocab, which holds every token.
        by_size = {int(n): x for n, x in report["diagnosis"][name]["vocab_coverage_by_size"].items()}
        eagle = [r for r in report["results"] if (r["dataset"], r["proposer"]) == (name, "eagle3")]
        size = int(load_manifest(store, drafter.prefix)["figures"]["draft_vocab_size"])
        assert all(by_size[size] == r["draft_vocab_coverage"] for r in eagle)
        assert (
            list(by_size.values()) == sorted(by_size.values()) and by_size[smollm2.geometry.vocab_size] == 1.0
        )
    assert "## Where acceptance is lost" in md and "a draft vocabulary of each size" in md
    # MT-Bench prompts carry their category: two questions are the first of the first two categories,
    # and the categories' figures add up to the dataset's (verify tokens over verify forwards).
    groups = [g for g in report["by_group"] if (g["proposer"], g["num_steps"]) == ("eagle3", 3)]
    assert [(g["dataset"], g["group"], g["prompts"]) for g in groups] == [
        ("mtbench", "roleplay", 1), ("mtbench", "writing", 1),
    ]  # fmt: skip
    rows = [r for r in per_prompt_rows(store, result) if (r["proposer"], r["num_steps"]) == ("eagle3", 3)]
    assert {r["id"]: r["group"] for r in rows if r["dataset"] == "mtbench"} == {
        "mtbench-81": "writing", "mtbench-91": "roleplay",
    }  # fmt: skip
    assert all(r["group"] is None for r in rows if r["dataset"] == "heldout")
    whole = next(
        r
        for r in report["results"]
        if (r["dataset"], r["proposer"], r["num_steps"]) == ("mtbench", "eagle3", 3)
    )
    tokens, verify = sum(g["verify_tokens"] for g in groups), sum(g["spec_verify_ct"] for g in groups)
    assert tokens / verify == pytest.approx(whole["accept_length"], abs=1e-4)
    assert "## Acceptance length by category" in md and "| writing | 1 | " in md
    assert store.get_bytes(f"{result.prefix}/acceptance.png")[:4] == b"\x89PNG"
    per_prompt = store.get_bytes(f"{result.prefix}/per_prompt.jsonl").decode().splitlines()
    assert len(per_prompt) == 16
    assert result.figures["accept_mtbench_prompt_lookup_k3"] >= 1.0
    assert result.figures["outputs_identical"] == "12/12"
    assert seen[-1][0] == 1.0 and all(0.0 <= f <= 1.0 for f, _ in seen)

    # Same inputs: a cache hit that decodes nothing.
    monkeypatch.setattr(SpecDecoder, "generate", _must_not_decode)
    again = run(CFG, store=store, run_name="r", target=smollm2, drafter=drafter, corpus=corpus)
    assert again.cache_hit and again.key == result.key

    # A crash after the measurements: the re-run rebuilds the report from the finished parts.
    stage_dir = StageDir(store, "r", "evaluate", result.key)
    store.delete(stage_dir.path("manifest.json"))
    store.delete(stage_dir.path("report.json"))
    resumed = run(CFG, store=store, run_name="r", target=smollm2, drafter=drafter, corpus=corpus)
    assert not resumed.cache_hit
    assert load_manifest(store, resumed.prefix)["results"] == report["results"]


def test_sampled_acceptance_is_measured_beside_greedy_and_resumes_identically(upstream, smollm2):
    store, corpus, drafter = upstream
    cfg = CFG.model_copy(update={"num_steps": [3], "temperatures": [0.0, 1.0], "proposers": ["eagle3"]})
    result = run(cfg, store=store, run_name="t", target=smollm2, drafter=drafter, corpus=corpus)
    report = json.loads(store.get_bytes(f"{result.prefix}/report.json"))
    by_t = {(r["dataset"], r["temperature"]): r for r in report["results"]}
    assert set(by_t) == {(d, t) for d in ("mtbench", "heldout") for t in (0.0, 1.0)}
    for r in by_t.values():
        assert 1.0 <= r["accept_length"] <= 4.0 and r["spec_verify_ct"] > 0
    assert set(result.figures) >= {"accept_mtbench_eagle3_k3", "accept_mtbench_eagle3_k3_t1"}
    # Only greedy runs are compared output by output (one greedy run per prompt here: nothing to compare).
    assert report["agreement"] == {"compared": 0, "identical": 0}
    md = store.get_bytes(f"{result.prefix}/report.md").decode()
    assert "| mtbench | eagle3 T=1 |" in md and "| mtbench | eagle3 |" in md
    # A sampled part redone after a crash draws the same tokens: its seed is its own, not the run's.
    stage_dir = StageDir(store, "t", "evaluate", result.key)
    store.delete(stage_dir.path("manifest.json"))
    store.delete(stage_dir.path("parts/mtbench-eagle3-k3-t1.json"))
    resumed = run(cfg, store=store, run_name="t", target=smollm2, drafter=drafter, corpus=corpus)
    assert untimed(load_manifest(store, resumed.prefix)["results"]) == untimed(report["results"])


def untimed(results):
    return [{k: v for k, v in r.items() if k not in ("seconds", "tokens_per_second")} for r in results]


def test_temperatures_are_checked_when_the_config_loads():
    with pytest.raises(ValueError, match="temperatures"):
        EvaluateConfig(temperatures=[-0.5])
    with pytest.raises(ValueError, match="twice"):
        EvaluateConfig(temperatures=[0.0, 0.0])


def per_prompt_rows(store, result):
    return [json.loads(line) for line in store.get_bytes(f"{result.prefix}/per_prompt.jsonl").splitlines()]


def _must_not_decode(*args, **kwargs):
    raise AssertionError("a cached or resumed evaluation must not decode again")


def test_a_train_result_without_a_drafter_is_a_clear_error(upstream, smollm2):
    store, corpus, _ = upstream
    empty = StageDir(store, "r", "train", "nodrafter").finish({"figures": {}})
    with pytest.raises(
        EvaluationError, match=r"no complete drafter: .*drafter/ lacks \['config.json', 'model.safetensors'\]"
    ):
        run(
            CFG.model_copy(update={"proposers": ["eagle3"]}),
            store=store,
            run_name="r",
            target=smollm2,
            drafter=empty,
            corpus=corpus,
        )


def test_an_mtbench_subset_spreads_over_the_categories():
    questions = load_mtbench()
    eight = spread_over_categories(questions, 8)
    assert [q.id for q in eight] == [f"mtbench-{81 + 10 * i}" for i in range(8)]  # the first of each
    assert len({q.category for q in eight}) == 8
    ten = spread_over_categories(questions, 10)  # then each category's second, in category order
    assert [q.id for q in ten] == ["mtbench-81", "mtbench-82", "mtbench-91", "mtbench-92"] + [
        f"mtbench-{101 + 10 * i}" for i in range(6)
    ]
    assert spread_over_categories(questions, 80) == questions
