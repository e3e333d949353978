"""Resume keys each conversation by its id *and* the input it was generated from: a source edited in
place (a prompt fixed, a kept answer corrected) is generated again for the conversations that changed
and only for them, never answered with what the old text gave; the manifest counts what was reused,
regenerated and changed. Real HTTP against tests/fault_server.py on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aerie.datasets import SourceSpec
from aerie.generate.config import DatasetSpec, EndpointConfig, GenerateConfig, SamplingParams
from aerie.generate.output import read_conversations
from aerie.generate.work import run
from aerie.manifest import load_manifest
from aerie.store import LocalStore
from tests.fault_server import FaultServer, answer_for
from tests.stage_work import dataset_dir

KEY_ENV = "AERIE_TEST_RESUME_KEY"


def write_source(path: Path, answers: dict[str, str], prompts: dict[str, str]) -> None:
    lines = [
        {
            "id": i,
            "conversations": [{"from": "human", "value": prompts[i]}, {"from": "gpt", "value": answers[i]}],
        }
        for i in sorted(prompts)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def setup(
    tmp_path: Path, url: str | None, regenerate: bool
) -> tuple[GenerateConfig, DatasetSpec, LocalStore]:
    endpoint = EndpointConfig(base_url=url, api_key_env=KEY_ENV, backoff_base_s=0.01, max_retries=1)
    cfg = GenerateConfig(endpoint=endpoint, max_failure_fraction=0.0)
    spec = DatasetSpec(
        name="toy",
        source=SourceSpec(kind="jsonl", path=str(tmp_path / "source.jsonl")),
        regenerate=regenerate,
        sampling=SamplingParams(max_tokens=16),
    )
    return cfg, spec, LocalStore(tmp_path / "store")


def rows(store: LocalStore, prefix: str) -> dict[str, list[dict[str, str | None]]]:
    frame = read_conversations(store.local_path(f"{prefix}/conversations.parquet"))
    return dict(zip(frame["id"].to_list(), frame["messages"].to_list(), strict=True))


@pytest.mark.integration  # a fault server on 127.0.0.1
def test_an_edited_prompt_is_asked_again_and_only_it(tmp_path: Path) -> None:
    prompts = {f"c{i}": f"question {i}" for i in range(4)}
    answers = {i: "data answer" for i in prompts}
    write_source(tmp_path / "source.jsonl", answers, prompts)
    with FaultServer() as server:
        cfg, spec, store = setup(tmp_path, server.url, regenerate=True)
        run(cfg, spec, dataset_dir(store, "r", cfg, spec))
        assert len(server.seen) == 4

        prompts["c2"] = "question 2, corrected"
        write_source(tmp_path / "source.jsonl", answers, prompts)  # fixed in place: same id, new text
        result = run(cfg, spec, dataset_dir(store, "r", cfg, spec))
        assert [s.prompt for s in server.seen[4:]] == ["question 2, corrected"]

    out = rows(store, result.prefix)
    fixed = [{"role": "user", "content": "question 2, corrected"}]
    assert out["c2"][0]["content"] == "question 2, corrected"
    assert out["c2"][1]["content"] == answer_for(fixed)  # the answer to the new text, not the old
    assert out["c1"][1]["content"] == answer_for([{"role": "user", "content": "question 1"}])
    counts = load_manifest(store, result.prefix)["counts"]
    assert (counts["reused"], counts["regenerated"], counts["changed"]) == (3, 1, 1)
    assert counts["done"] == 4


def test_a_corrected_kept_answer_replaces_the_old_one(tmp_path: Path) -> None:
    prompts = {f"c{i}": f"question {i}" for i in range(3)}
    answers = {i: f"answer {i}" for i in prompts}
    write_source(tmp_path / "source.jsonl", answers, prompts)
    cfg, spec, store = setup(tmp_path, None, regenerate=False)
    run(cfg, spec, dataset_dir(store, "r", cfg, spec))

    answers["c0"] = "answer c0, corrected"
    write_source(tmp_path / "source.jsonl", answers, prompts)
    result = run(cfg, spec, dataset_dir(store, "r", cfg, spec))
    out = rows(store, result.prefix)
    assert out["c0"][1]["content"] == "answer c0, corrected"
    assert out["c1"][1]["content"] == "answer c1"
    counts = load_manifest(store, result.prefix)["counts"]
    assert (counts["reused"], counts["regenerated"], counts["changed"]) == (2, 1, 1)


def test_a_record_without_its_input_digest_is_not_reused(tmp_path: Path) -> None:
    """A journal record that does not say what it was generated from cannot prove it is current."""
    prompts = {"c0": "question 0", "c1": "question 1"}
    write_source(tmp_path / "source.jsonl", {i: "x" for i in prompts}, prompts)
    cfg, spec, store = setup(tmp_path, None, regenerate=False)
    first = run(cfg, spec, dataset_dir(store, "r", cfg, spec))
    journal = next(Path(store.root, "r", "generate-toy", "journal").rglob("part-*.jsonl"))
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    for rec in records:
        rec.pop("input_sha256")
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    Path(store.local_path(f"{first.prefix}/manifest.json")).unlink()
    result = run(cfg, spec, dataset_dir(store, "r", cfg, spec))
    counts = load_manifest(store, result.prefix)["counts"]
    assert (counts["reused"], counts["regenerated"], counts["changed"]) == (
        0,
        2,
        2,
    )  # held under no input: counted as changed


@pytest.fixture(autouse=True)
def _no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
