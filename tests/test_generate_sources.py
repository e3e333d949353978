"""What the generation stage does with the source file itself: a source that yields nothing valid (or
mostly malformed records) fails its stage naming the reasons and the lines; a file fixed in place is a
new input, never a cache hit; skipped lines are reported with their line numbers. Real files, the real
`run()` on a local store (kept datasets: no endpoint is needed to read a source)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from aerie.datasets import SourceSpec
from aerie.errors import DataError
from aerie.generate.config import DatasetSpec, GenerateConfig
from aerie.generate.work import key_of, run
from aerie.manifest import load_manifest
from aerie.store import LocalStore
from tests.stage_work import dataset_dir


def record(cid: str, *turns: tuple[str, str], role: str = "from", content: str = "value") -> dict[str, Any]:
    return {"id": cid, "conversations": [{role: r, content: c} for r, c in turns]}


def write_jsonl(path: Path, lines: list[Any], *, cut_tail: str | None = None) -> Path:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    path.write_text(text + (cut_tail or ""), encoding="utf-8")
    return path


def setup(path: Path, **source: Any) -> tuple[GenerateConfig, DatasetSpec]:
    spec = DatasetSpec(
        name="local", source=SourceSpec(kind="jsonl", path=str(path), **source), regenerate=False
    )
    return GenerateConfig(datasets=[spec]), spec


def test_a_source_with_no_valid_record_fails_and_its_fix_in_place_reruns(tmp_path: Path) -> None:
    # The right top-level field, the wrong per-turn keys (role/content where the spec expects from/value).
    path = write_jsonl(
        tmp_path / "chats.jsonl",
        [
            record(f"c{i}", ("user", "q"), ("assistant", "a"), role="role", content="content")
            for i in range(4)
        ],
    )
    cfg, spec = setup(path)
    store = LocalStore(tmp_path / "store")
    with pytest.raises(DataError) as err:
        run(cfg, spec, dataset_dir(store, "r", cfg, spec))
    text = str(err.value)
    assert "no valid conversation" in text and str(path) in text
    assert "4 of 4 records skipped (turn_missing_field 4)" in text
    assert "line 1 (id 'c0'): turn_missing_field (turn fields ['content', 'role'])" in text
    assert "content_field='value'" in text

    # Fixed in place, same path: the re-run reads the new bytes instead of answering from a cache.
    write_jsonl(path, [record(f"c{i}", ("user", "q"), ("assistant", "a")) for i in range(4)])
    result = run(cfg, spec, dataset_dir(store, "r", cfg, spec))
    assert not result.cache_hit and result.figures["records"] == 4


def test_a_rewrite_in_place_with_the_same_size_and_mtime_is_a_new_key(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chats.jsonl", [record("c0", ("human", "question A"), ("gpt", "answer"))])
    cfg, spec = setup(path)
    store = LocalStore(tmp_path / "store")
    first = run(cfg, spec, dataset_dir(store, "r", cfg, spec))
    assert run(cfg, spec, dataset_dir(store, "r", cfg, spec)).cache_hit
    before = path.stat()
    write_jsonl(path, [record("c0", ("human", "question B"), ("gpt", "answer"))])
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # as `cp -p` or an unpacked archive leaves it
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    second = run(cfg, spec, dataset_dir(store, "r", cfg, spec))
    assert second.key != first.key and not second.cache_hit


def test_the_acceptance_threshold_is_outside_the_key(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chats.jsonl", [record("c0", ("human", "q"), ("gpt", "a"))])
    cfg, spec = setup(path)
    loose = spec.model_copy(update={"source": spec.source.model_copy(update={"max_invalid_fraction": 0.9})})
    assert key_of(cfg, spec) == key_of(cfg, loose)


def test_more_malformed_records_than_allowed_fail_with_counts_and_lines(tmp_path: Path) -> None:
    good = [record(f"ok{i}", ("human", "q"), ("gpt", "a")) for i in range(2)]
    bad = [record("robot", ("human", "q"), ("robot", "a")), ["not", "a", "record"], {"id": "x"}]
    path = write_jsonl(tmp_path / "mixed.jsonl", good + bad)
    cfg, spec = setup(path)
    store = LocalStore(tmp_path / "store")
    with pytest.raises(DataError) as err:
        run(cfg, spec, dataset_dir(store, "r", cfg, spec))
    text = str(err.value)
    assert "60% of the records read are malformed" in text and "max_invalid_fraction (20%)" in text
    assert "line 3 (id 'robot'): unknown_role" in text and "line 4: not_a_dict" in text
    assert "missing_messages 1" in text

    cfg, spec = setup(path, max_invalid_fraction=0.6)  # a share the user accepts for this file
    assert run(cfg, spec, dataset_dir(store, "r", cfg, spec)).figures["records"] == 2


def test_skipped_lines_are_reported_with_their_line_numbers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = [record(f"ok{i}", ("human", "q"), ("gpt", "a")) for i in range(8)]
    lines: list[Any] = [*good[:2], "[1, 2]", *good[2:]]
    path = write_jsonl(tmp_path / "cut.jsonl", lines, cut_tail='{"id": "late", "conversations": [{"fr')
    cfg, spec = setup(path)
    store = LocalStore(tmp_path / "store")
    with caplog.at_level(logging.WARNING, logger="aerie.generate.work"):
        result = run(cfg, spec, dataset_dir(store, "r", cfg, spec))
    loader = load_manifest(store, result.prefix)["loader"]
    assert loader["skipped"] == {"not_a_dict": 1, "truncated_tail": 1}
    assert loader["examples"][0] == "line 3: not_a_dict (a list)"
    assert loader["examples"][1].startswith("line 10: truncated_tail")
    assert "the last line (line 10) is cut off" in loader["truncated"]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "line 3: not_a_dict" in logged and "line 10: truncated_tail" in logged
    assert result.figures["records"] == 8


@pytest.mark.integration  # the regenerated case asks the fault server on 127.0.0.1
@pytest.mark.parametrize("regenerate", [False, True])
def test_a_lone_surrogate_is_replaced_and_counted_and_the_rest_is_generated(
    tmp_path: Path, regenerate: bool
) -> None:
    from aerie.generate.config import EndpointConfig
    from aerie.generate.output import read_conversations
    from tests.fault_server import FaultServer

    # As a scraper writes half an emoji: the JSON escape of one UTF-16 surrogate without its partner.
    broken = '{"id": "half\\ud83d", "conversations": [{"from": "human", "value": "smile \\ud83d please"}, {"from": "gpt", "value": "ok \\ude00"}]}'
    whole = record("whole", ("human", "a pair \ud83d\ude00 is fine"), ("gpt", "yes"))
    path = write_jsonl(
        tmp_path / "scraped.jsonl", [broken, whole, record("plain", ("human", "q"), ("gpt", "a"))]
    )
    store = LocalStore(tmp_path / "store")
    with FaultServer() as server:
        spec = DatasetSpec(
            name="local", source=SourceSpec(kind="jsonl", path=str(path)), regenerate=regenerate
        )
        cfg = GenerateConfig(datasets=[spec], endpoint=EndpointConfig(base_url=server.url, max_retries=0))
        result = run(cfg, spec, dataset_dir(store, "r", cfg, spec))
        prompts = sorted(s.prompt for s in server.seen)
    assert result.figures["records"] == 3 and result.figures["failed"] == 0
    assert load_manifest(store, result.prefix)["loader"]["repaired"] == {"lone_surrogate_replaced": 1}
    frame = read_conversations(store.local_path(f"{result.prefix}/conversations.parquet"))
    rows = {r["id"]: r for r in frame.to_dicts()}
    assert sorted(rows) == ["half\ufffd", "plain", "whole"]
    assert rows["half\ufffd"]["messages"][0]["content"] == "smile \ufffd please"
    assert rows["whole"]["messages"][0]["content"] == "a pair \U0001f600 is fine"  # a pair is one character
    if regenerate:
        assert prompts == ["a pair \U0001f600 is fine", "q", "smile \ufffd please"]
    else:
        assert prompts == [] and rows["half\ufffd"]["messages"][1]["content"] == "ok \ufffd"
