"""The generation stage against real HTTP servers on 127.0.0.1 (tests/fault_server.py): faults are
retried and every record arrives exactly once, a rejected key stops at once without leaking it,
kill -9 of a generating process loses nothing and duplicates nothing, outputs keep their schema."""

from __future__ import annotations

import email.utils
import json
import math
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from aerie.config import PipelineConfig
from aerie.conversation import Conversation, Message
from aerie.datasets import SourceSpec
from aerie.errors import EndpointAuthError, EndpointError, EndpointRequestError, StoreError
from aerie.generate.client import parse_retry_after
from aerie.generate.config import DatasetSpec, EndpointConfig, GenerateConfig, SamplingParams
from aerie.generate.output import SCHEMA, read_conversations
from aerie.generate.runner import longest_first
from aerie.generate.stage import generate_config
from aerie.generate.turns import prepare
from aerie.generate.work import generate_dataset, key_of, run, stage_name
from aerie.manifest import StageDir, load_manifest
from aerie.store import LocalStore
from tests.fault_server import (
    BLANK_ANSWER,
    DROP,
    EMPTY_CHOICES,
    IN_BAND_ERROR,
    MALFORMED,
    REASONING_ONLY,
    Fault,
    FaultServer,
    answer_for,
    slow,
    status,
)
from tests.generate_support import check_resumed, journal_of, kill_mid_run
from tests.stage_work import dataset_dir

KEY_ENV = "AERIE_TEST_GENERATE_KEY"


@pytest.fixture(autouse=True)
def _no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)


@pytest.fixture
def server():
    with FaultServer() as srv:
        yield srv


def conversations(n: int, turns: int = 2, source: str = "toy") -> list[Conversation]:
    """n conversations of `turns` user turns, each followed by a stale assistant turn to be replaced."""
    out = []
    for i in range(n):
        messages: list[Message] = []
        for t in range(turns):
            messages.append(Message(role="user", content=f"question {i}.{t}"))
            messages.append(Message(role="assistant", content="stale answer from the dataset"))
        out.append(Conversation(id=f"c{i:03d}", source=source, messages=tuple(messages)))
    return out


def config(url: str, **endpoint: Any) -> GenerateConfig:
    fields: dict[str, Any] = {
        "base_url": url,
        "api_key_env": KEY_ENV,
        "concurrency": 8,
        "connect_timeout_s": 2.0,
        "read_timeout_s": 0.5,
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.05,
        "max_retries": 4,
        **endpoint,
    }
    return GenerateConfig(endpoint=EndpointConfig(**fields), max_failure_fraction=0.0)


def spec_for(name: str = "toy", **kw: Any) -> DatasetSpec:
    kw.setdefault("sampling", SamplingParams(max_tokens=32))
    return DatasetSpec(name=name, source=SourceSpec(kind="jsonl", path="unused.jsonl"), **kw)


def stage_dir_of(store: LocalStore, cfg: GenerateConfig, spec: DatasetSpec) -> StageDir:
    return StageDir(store, "r", stage_name(spec), key_of(cfg, spec))


def expected_messages(conv: Conversation, system: str | None = None) -> list[dict[str, Any]]:
    """The regenerated conversation the fault server's deterministic answers must produce."""
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    out = [{"role": "system", "content": system, "reasoning": None}] if system else []
    for m in conv.messages:
        if m.role != "user":
            continue
        history.append({"role": "user", "content": m.content})
        answer = answer_for(history)
        history.append({"role": "assistant", "content": answer})
        out += [{"role": "user", "content": m.content, "reasoning": None}]
        out += [{"role": "assistant", "content": answer, "reasoning": None}]
    return out


def read_output(store: LocalStore, prefix: str) -> pl.DataFrame:
    return read_conversations(store.local_path(f"{prefix}/conversations.parquet"))


@pytest.mark.parametrize("transport", ["lean", "httpcore"])
@pytest.mark.integration
def test_transient_faults_are_retried_and_every_record_arrives_once(
    server: FaultServer, tmp_path: Path, transport: str
):
    # An HTTP date has whole seconds: 3-4 s ahead, so that it is still ahead when the 429 is served.
    retry_at = math.ceil(time.time()) + 3
    retry_date = email.utils.formatdate(retry_at, usegmt=True)
    server.plan = {
        "question 0.0": [status(429, retry_after="1")],
        "question 1.0": [status(429, retry_after=retry_date)],
        "question 2.0": [status(500), status(503), status(503)],
        "question 3.1": [slow(1.5)],  # past the 0.5 s read timeout
        "question 4.0": [MALFORMED],
        "question 5.1": [EMPTY_CHOICES],
        "question 6.0": [DROP],
        "question 7.0": [IN_BAND_ERROR, status(502)],
        "question 8.0": [status(408), status(409)],
    }
    convs = conversations(12)
    # One worker per conversation: every first request opens its own connection, so the dropped one
    # is counted (a drop on a reused keep-alive connection is retried as a stale one, silently).
    cfg, spec = config(server.url, http_transport=transport, concurrency=12), spec_for()
    store = LocalStore(tmp_path / "store")
    result = generate_dataset(convs, cfg, spec, stage_dir=stage_dir_of(store, cfg, spec), base_url=server.url)

    frame = read_output(store, result.prefix)
    assert frame.schema == SCHEMA
    assert frame["id"].to_list() == [c.id for c in convs]  # input order, each exactly once
    for conv, row in zip(convs, frame.iter_rows(named=True), strict=True):
        assert row["messages"] == expected_messages(conv)
        assert row["finish_reasons"] == ["stop", "stop"]
    manifest = load_manifest(store, result.prefix)
    assert manifest["counts"]["done"] == 12 and manifest["counts"]["failed"] == 0
    assert manifest["retries_by_kind"] == {
        "http_429": 2,
        "http_500": 1,
        "http_503": 2,
        "timeout": 1,
        "malformed_json": 1,
        "empty_choices": 1,
        "connection": 1,
        "endpoint_error": 1,
        "http_502": 1,
        "http_408": 1,
        "http_409": 1,
    }
    # Retry-After was honoured (seconds and HTTP-date forms): the retry came no earlier than asked.
    first, second = server.requests_for("question 0.0")[:2]
    assert second.at - first.at >= 0.9
    first, second = server.requests_for("question 1.0")[:2]
    wall = time.time() - time.monotonic()  # the server stamps requests with the monotonic clock
    assert second.at + wall >= retry_at - 0.05
    assert (store.local_path(f"{result.prefix}/errors.jsonl")).read_text() == ""


@pytest.mark.integration
def test_rejected_key_stops_at_once_and_is_never_written(
    server: FaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    secret = "sk-or-v1-THIS-KEY-MUST-NOT-LEAK-0123456789"
    server.api_key = "sk-or-v1-the-right-one"
    monkeypatch.setenv(KEY_ENV, secret)
    cfg, spec = config(server.url, concurrency=2), spec_for()
    store = LocalStore(tmp_path / "store")
    with pytest.raises(EndpointAuthError) as info:
        generate_dataset(
            conversations(20), cfg, spec, stage_dir=stage_dir_of(store, cfg, spec), base_url=server.url
        )
    message = str(info.value)
    assert f"rejected the API key in ${KEY_ENV} (HTTP 401): check the key" in message
    assert secret not in message and "***" in message  # the server echoed it; the client scrubbed it
    # Stopped at once: nothing retried, no more than the requests already in flight.
    prompts = [s.prompt for s in server.seen]
    assert len(prompts) <= 2 and len(set(prompts)) == len(prompts)
    assert server.seen[0].authorization == f"Bearer {secret}"
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


@pytest.mark.integration
def test_no_key_means_no_authorization_header(server: FaultServer, tmp_path: Path):
    cfg, spec = config(server.url), spec_for()
    store = LocalStore(tmp_path / "store")
    generate_dataset(
        conversations(2, turns=1), cfg, spec, stage_dir=stage_dir_of(store, cfg, spec), base_url=server.url
    )
    assert [s.authorization for s in server.seen] == [None, None]


@pytest.mark.integration
def test_openrouter_fields_reasoning_cost_and_truncation(
    server: FaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    server.reasoning, server.cost = True, 0.0025
    monkeypatch.setenv(KEY_ENV, "sk-test")
    cfg = config(
        server.url,
        model="moonshotai/kimi-k2.5",
        referer="https://example.org/aerie",
        title="aerie-test",
        provider={"order": ["groq"], "allow_fallbacks": False},
    )
    spec = spec_for(
        system_prompt="Be brief.",
        max_turns=1,
        sampling=SamplingParams(
            temperature=0.6, max_tokens=64, top_k=20, extra_body={"reasoning": {"effort": "low"}}
        ),
    )
    convs = [
        Conversation(id="a", source="toy", messages=(Message(role="user", content="hi [long]"),)),
        *conversations(1, turns=3),
    ]
    store = LocalStore(tmp_path / "store")
    result = generate_dataset(convs, cfg, spec, stage_dir=stage_dir_of(store, cfg, spec), base_url=server.url)
    body = server.seen[0].body
    assert body["model"] == "moonshotai/kimi-k2.5" and body["provider"] == {
        "order": ["groq"],
        "allow_fallbacks": False,
    }
    assert body["reasoning"] == {"effort": "low"} and body["top_k"] == 20 and body["max_tokens"] == 64
    assert body["messages"][0] == {"role": "system", "content": "Be brief."}
    frame = read_output(store, result.prefix)
    rows = {r["id"]: r for r in frame.iter_rows(named=True)}
    assert rows["a"]["truncated"] is True and rows["a"]["finish_reasons"] == ["length"]
    assert rows["a"]["messages"][2]["reasoning"] == "thinking about hi [long]"
    assert "thinking" not in rows["a"]["messages"][2]["content"]  # reasoning kept apart from the answer
    assert len(rows["c000"]["messages"]) == 3  # system + max_turns=1 user turn + its answer
    assert rows["c000"]["cost"] == pytest.approx(0.0025)
    manifest = load_manifest(store, result.prefix)
    assert manifest["figures"]["cost_usd"] == pytest.approx(0.005) and manifest["counts"]["truncated"] == 1
    assert manifest["endpoint"]["models_served"] == {"moonshotai/kimi-k2.5": 2}


@pytest.mark.integration
def test_request_errors_that_retrying_cannot_fix(server: FaultServer, tmp_path: Path):
    store = LocalStore(tmp_path / "store")
    cfg, spec = config(server.url, concurrency=1), spec_for(max_turns=1)
    server.default = status(404)
    with pytest.raises(EndpointRequestError, match="not found: check endpoint.base_url"):
        generate_dataset(
            conversations(3), cfg, spec, stage_dir=stage_dir_of(store, cfg, spec), base_url=server.url
        )
    assert len(server.seen) == 1

    # A 400 before anything worked is the configuration's fault: stop.
    server.default = status(400, body='{"error": "temperature must be <= 1"}')
    with pytest.raises(EndpointRequestError, match="the request itself is wrong"):
        generate_dataset(
            conversations(3), cfg, spec, stage_dir=stage_dir_of(store, cfg, spec), base_url=server.url
        )

    # After successes, a 400 is that one prompt's fault: it fails alone and is not retried.
    from tests.fault_server import OK

    server.default, server.seen = OK, []
    server.plan = {"question 2.0": [status(400, body="prompt is too long")]}
    cfg.max_failure_fraction = 0.5
    result = generate_dataset(
        conversations(3), cfg, spec, stage_dir=stage_dir_of(store, cfg, spec), base_url=server.url
    )
    errors = [json.loads(line) for line in store.get_bytes(f"{result.prefix}/errors.jsonl").splitlines()]
    assert errors == [{"id": "c002", "kind": "rejected", "message": errors[0]["message"], "attempts": 1}]
    assert len(server.requests_for("question 2.0")) == 1
    assert result.figures["records"] == 2 and result.figures["failed"] == 1


@pytest.mark.integration
def test_failures_over_the_budget_fail_the_dataset_and_the_rerun_retries_only_them(
    server: FaultServer, tmp_path: Path
):
    server.plan = {"question 3.0": [status(503)] * 5}  # more than max_retries=4 allows
    cfg, spec = config(server.url), spec_for(max_turns=1)
    store = LocalStore(tmp_path / "store")
    stage_dir = stage_dir_of(store, cfg, spec)
    with pytest.raises(EndpointError, match=r"1 of 6 conversations failed .*'http_503': 1"):
        generate_dataset(conversations(6), cfg, spec, stage_dir=stage_dir, base_url=server.url)
    assert stage_dir.manifest() is None  # not complete
    errors = store.get_bytes(stage_dir.path("errors.jsonl")).decode()
    assert json.loads(errors)["id"] == "c003" and json.loads(errors)["attempts"] == 5

    before = len(server.seen)
    result = generate_dataset(conversations(6), cfg, spec, stage_dir=stage_dir, base_url=server.url)
    assert [s.prompt for s in server.seen[before:]] == ["question 3.0"]  # only the failure again
    frame = read_output(store, result.prefix)
    assert sorted(frame["id"].to_list()) == [f"c{i:03d}" for i in range(6)]


@pytest.mark.integration
def test_an_empty_final_answer_is_an_error_record_never_a_good_sample(server: FaultServer, tmp_path: Path):
    # Turn 1 of c001 is all reasoning (cut at max_tokens), turn 2 of c002 is whitespace: neither
    # conversation may come out as a good sample with an empty assistant turn.
    server.plan = {"question 1.0": [REASONING_ONLY], "question 2.1": [BLANK_ANSWER]}
    cfg, spec = config(server.url), spec_for()
    cfg = cfg.model_copy(update={"max_failure_fraction": 0.5})
    store = LocalStore(tmp_path / "store")
    result = generate_dataset(
        conversations(4), cfg, spec, stage_dir=stage_dir_of(store, cfg, spec), base_url=server.url
    )
    frame = read_output(store, result.prefix)
    assert sorted(frame["id"].to_list()) == ["c000", "c003"]
    for row in frame.iter_rows(named=True):
        assert all(m["content"].strip() for m in row["messages"])
    errors = {
        e["id"]: e
        for e in map(json.loads, store.get_bytes(f"{result.prefix}/errors.jsonl").decode().splitlines())
    }
    assert errors["c001"]["kind"] == errors["c002"]["kind"] == "empty_answer"
    assert errors["c001"]["reasoning"] == "Let me think step by step about this"  # kept, in its own field
    assert (
        errors["c001"]["finish_reason"] == "length"
        and "raise sampling.max_tokens (32)" in errors["c001"]["message"]
    )
    assert "whitespace" in errors["c002"]["message"] and errors["c002"]["reasoning"] is None
    assert "assistant turn 2" in errors["c002"]["message"]
    assert load_manifest(store, result.prefix)["errors_by_kind"] == {"empty_answer": 2}

    # The next run retries exactly those two, which now answer, and completes the dataset.
    before = len(server.seen)
    again = generate_dataset(
        conversations(4), cfg, spec, stage_dir=stage_dir_of(store, cfg, spec), base_url=server.url
    )
    assert sorted(s.prompt for s in server.seen[before:]) == [
        "question 1.0",
        "question 1.1",
        "question 2.0",
        "question 2.1",
    ]
    assert sorted(read_output(store, again.prefix)["id"].to_list()) == ["c000", "c001", "c002", "c003"]


@pytest.mark.integration  # a local fault server
def test_reasoning_left_inline_is_split_off_and_a_reasoning_only_answer_is_refused(
    server: FaultServer, tmp_path: Path
):
    # An endpoint without a reasoning parser: the think block arrives inside `content`.
    server.plan = {
        "question 0.0": [Fault(content="<think>\nfirst R\n</think>\n\nthe answer")],
        "question 1.0": [Fault(content="<think>only thinking</think>\n")],  # closed, nothing after
        "question 2.0": [Fault(content="<think>cut off inside", finish_reason="length")],
        "question 3.0": [REASONING_ONLY],  # the same answer in the reasoning field
    }
    cfg, spec = config(server.url), spec_for()
    cfg = cfg.model_copy(update={"max_failure_fraction": 1.0})
    store = LocalStore(tmp_path / "store")
    result = generate_dataset(
        conversations(4), cfg, spec, stage_dir=stage_dir_of(store, cfg, spec), base_url=server.url
    )
    (row,) = read_output(store, result.prefix).to_dicts()
    assert row["id"] == "c000"
    assert row["messages"][1] == {"role": "assistant", "content": "the answer", "reasoning": "\nfirst R\n"}
    # The next turn's history holds the answer only, never the think block.
    (second,) = server.requests_for("question 0.1")
    assert second.body["messages"][1] == {"role": "assistant", "content": "the answer"}
    errors = {
        e["id"]: e
        for e in map(json.loads, store.get_bytes(f"{result.prefix}/errors.jsonl").decode().splitlines())
    }
    assert {i: e["kind"] for i, e in errors.items()} == {
        "c001": "empty_answer",
        "c002": "empty_answer",
        "c003": "empty_answer",
    }
    assert (errors["c001"]["reasoning"], errors["c002"]["reasoning"]) == ("only thinking", "cut off inside")
    assert all("only reasoning" in e["message"] for e in errors.values())


@pytest.mark.integration
def test_kill_9_mid_run_then_rerun_yields_each_record_exactly_once(server: FaultServer, tmp_path: Path):
    """Generation runs in a child process (the real `run()`, reading a JSONL source); it is killed
    with SIGKILL while requests are in flight, then a re-run finishes the dataset."""
    n = 40
    source = tmp_path / "source.jsonl"
    with open(source, "w") as f:
        for conv in conversations(n, turns=1):
            f.write(
                json.dumps(
                    {"id": conv.id, "conversations": [{"from": "human", "value": conv.messages[0].content}]}
                )
                + "\n"
            )
    cfg = config(server.url, concurrency=4, read_timeout_s=5.0)
    spec = DatasetSpec(
        name="toy", source=SourceSpec(kind="jsonl", path=str(source)), sampling=SamplingParams(max_tokens=8)
    )
    store_root = tmp_path / "store"
    server.delay_s = 0.3  # slow enough to catch the child mid-run, after its first time record

    def second_writer_refused(child) -> None:
        # A second process generating into the same journal is refused while the child holds it (after
        # the kill, the re-run below takes the lock: the kernel dropped the dead child's).
        with pytest.raises(StoreError, match=rf"another generation is writing to .* \(pid {child.pid}\)"):
            run(cfg, spec, dataset_dir(LocalStore(store_root), "r", cfg, spec), base_url=server.url)

    done_before_kill = kill_mid_run(
        cfg, spec, store_root, server.url, at_lines=8, while_running=second_writer_refused
    )
    assert 8 <= len(done_before_kill) < n

    server.delay_s = 0.0
    asked_before = len(server.seen)
    store = LocalStore(store_root)
    result = run(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
    check_resumed(
        store, result, journal_of(store_root, spec), [f"c{i:03d}" for i in range(n)], done_before_kill
    )
    frame = read_output(store, result.prefix)
    for row in frame.iter_rows(named=True):
        assert row["messages"][1]["content"] == answer_for(
            [{"role": "user", "content": row["messages"][0]["content"]}]
        )
    asked_again = {s.prompt for s in server.seen[asked_before:]}
    assert not asked_again & {f"question {int(i[1:])}.0" for i in done_before_kill}  # nothing redone


@pytest.mark.integration
def test_run_caches_and_writes_the_manifest_without_secrets(
    server: FaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(KEY_ENV, "sk-secret-value-xyz")
    source = tmp_path / "data.jsonl"
    lines = [
        {"id": "x1", "conversations": [{"from": "human", "value": "one"}, {"from": "gpt", "value": "old"}]},
        {"id": "x2", "conversations": [{"from": "gpt", "value": "no question here"}]},
        {"id": "x3", "conversations": [{"from": "human", "value": "three"}]},
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in lines))
    cfg = config(server.url)
    # One of three records is malformed on purpose: accept that share for this file.
    spec = DatasetSpec(
        name="mini", source=SourceSpec(kind="jsonl", path=str(source), max_invalid_fraction=0.5)
    )
    store = LocalStore(tmp_path / "store")
    first = run(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=server.url)
    assert not first.cache_hit and first.stage == "generate-mini"
    asked = len(server.seen)

    # Another URL, concurrency and timeouts do not change what is generated: a cache hit.
    cfg2 = cfg.model_copy(deep=True)
    cfg2.endpoint.concurrency, cfg2.endpoint.read_timeout_s = 3, 9.0
    second = run(cfg2, spec, dataset_dir(store, "r", cfg2, spec), base_url="http://127.0.0.1:9/v1")
    assert second.cache_hit and second.prefix == first.prefix and len(server.seen) == asked

    manifest = load_manifest(store, first.prefix)
    assert manifest["generation"]["params_hash"] and manifest["endpoint"]["base_url"] == server.url
    assert manifest["schema"] == {name: str(dtype) for name, dtype in SCHEMA.items()}
    assert (
        manifest["counts"]["requested"]
        + manifest["counts"]["skipped_by_loader"]
        + sum(manifest["counts"]["skipped"].values())
        == 3
    )
    for key in ("prompt_tokens", "completion_tokens", "cost_usd", "requests_per_s", "tokens_per_s", "wall_s"):
        assert key in manifest["figures"]
    text = json.dumps(manifest)
    assert "sk-secret-value-xyz" not in text and "Authorization" not in text
    frame = read_output(store, first.prefix)
    assert frame.schema == SCHEMA and frame["params_hash"].unique().to_list() == [
        manifest["generation"]["params_hash"]
    ]


def test_a_kept_dataset_writes_the_same_schema_without_an_endpoint(tmp_path: Path):
    cfg = GenerateConfig()  # no base_url at all: nothing is asked
    spec = spec_for(regenerate=False, max_turns=1, system_prompt="sys")
    store = LocalStore(tmp_path / "store")
    result = generate_dataset(conversations(3), cfg, spec, stage_dir=stage_dir_of(store, cfg, spec))
    frame = read_output(store, result.prefix)
    assert frame.schema == SCHEMA and frame.height == 3
    row = frame.row(0, named=True)
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
    assert row["messages"][2]["content"] == "stale answer from the dataset"
    assert row["finish_reasons"] == [] and row["cost"] is None and row["truncated"] is False


@pytest.mark.integration
def test_rate_limit_paces_requests(server: FaultServer, tmp_path: Path):
    cfg, spec = config(server.url, requests_per_minute=600.0), spec_for(max_turns=1)
    store = LocalStore(tmp_path / "store")
    generate_dataset(
        conversations(16), cfg, spec, stage_dir=stage_dir_of(store, cfg, spec), base_url=server.url
    )
    times = sorted(s.at for s in server.seen)
    # 10 requests/s with a burst of one second's worth (10): the other six need at least 0.6 s.
    assert len(times) == 16 and times[-1] - times[0] >= 0.55


@pytest.mark.integration
def test_turns_past_max_context_tokens_are_not_asked(server: FaultServer, tmp_path: Path):
    # The fault server counts words as tokens: after any first answer the conversation is past 4.
    convs = conversations(3, turns=3)
    cfg, spec = config(server.url), spec_for(max_context_tokens=4)
    store = LocalStore(tmp_path / "store")
    result = generate_dataset(convs, cfg, spec, stage_dir=stage_dir_of(store, cfg, spec), base_url=server.url)

    frame = read_output(store, result.prefix)
    for conv, row in zip(convs, frame.iter_rows(named=True), strict=True):
        assert row["messages"] == expected_messages(conv)[:2]  # ends on its first answer
        assert row["finish_reasons"] == ["stop"]
    assert not [s for s in server.seen if not s.prompt.endswith(".0")]  # no later turn was asked
    assert load_manifest(store, result.prefix)["counts"]["turns_past_context"] == 3 * 2

    unlimited = spec_for(max_context_tokens=0)  # 0: every turn, and a dataset of its own
    assert key_of(cfg, unlimited) != key_of(cfg, spec)
    result = generate_dataset(
        convs, cfg, unlimited, stage_dir=stage_dir_of(store, cfg, unlimited), base_url=server.url
    )
    rows = read_output(store, result.prefix).iter_rows(named=True)
    assert [row["messages"] for row in rows] == [expected_messages(c) for c in convs]


def test_the_longest_conversations_go_first_and_the_pipeline_limits_them_to_the_corpus():
    prepared = [p for p in (prepare(c, spec_for()) for c in conversations(12)) if not isinstance(p, str)]
    order = [p.id for p in longest_first(prepared)]
    assert order[:2] == ["c010", "c011"] and order[2:] == [f"c{i:03d}" for i in range(10)]  # stable

    cfg = PipelineConfig()
    cfg.corpus.max_length = 300
    cfg.generate.datasets = [
        spec_for("a"),
        spec_for("b", max_context_tokens=0),
        spec_for("c", max_context_tokens=9),
    ]
    assert [d.max_context_tokens for d in generate_config(cfg).datasets] == [300, 0, 9]
    assert cfg.generate.datasets[0].max_context_tokens is None  # the config itself is left as it was


def test_prepare_turns():
    msgs = (
        Message(role="assistant", content="greeting"),
        Message(role="user", content="a"),
        Message(role="user", content="b"),
        Message(role="assistant", content="x"),
        Message(role="user", content="c"),
        Message(role="assistant", content="y"),
    )
    conv = Conversation(id="1", source="s", messages=msgs)
    regen = prepare(conv, spec_for(max_turns=2, system_prompt="S"))
    assert not isinstance(regen, str)
    assert [(m.role, m.content) for m in regen.messages] == [
        ("system", "S"),
        ("user", "a"),
        ("user", "b"),
        ("assistant", ""),  # one answer to both questions, where the data answered them
    ]
    kept = prepare(conv, spec_for(regenerate=False, max_turns=3))
    assert not isinstance(kept, str) and [m.content for m in kept.messages] == [
        "greeting",
        "a",
        "b",
        "x",
        "c",
        "y",
    ]
    only_answer = Conversation(id="2", source="s", messages=(Message(role="assistant", content="x"),))
    assert prepare(only_answer, spec_for()) == "no_user_turn"
    ask = Conversation(id="3", source="s", messages=(Message(role="user", content="q"),))
    assert prepare(ask, spec_for(regenerate=False)) == "no_assistant_turn"


def test_parse_retry_after():
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after("0.5") == 0.5
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    when = email.utils.formatdate(1_000_030.0, usegmt=True)
    assert parse_retry_after(when, now=1_000_000.0) == pytest.approx(30.0)
    assert parse_retry_after(email.utils.formatdate(10.0, usegmt=True), now=1_000.0) == 0.0


@pytest.mark.integration
def test_a_cost_summed_over_some_priced_answers_says_it_is_partial(server: FaultServer, tmp_path: Path):
    """An endpoint that prices some answers and not others: `cost_usd` is the priced ones' sum, marked
    `cost_usd_partial` with the `unpriced` count; all priced, or none, is not partial."""
    store = LocalStore(tmp_path / "store")

    def figures(name: str) -> dict[str, Any]:
        cfg, spec = config(server.url), spec_for(name)
        result = generate_dataset(
            conversations(3, turns=1),
            cfg,
            spec,
            stage_dir=stage_dir_of(store, cfg, spec),
            base_url=server.url,
        )
        return load_manifest(store, result.prefix)["figures"]

    server.cost = 0.001
    server.plan = {"question 1.0": [Fault(unpriced=True)]}
    partial = figures("partial")
    assert partial["cost_usd"] == pytest.approx(0.002)
    assert partial["cost_usd_partial"] is True and partial["unpriced"] == 1
    whole = figures("whole")
    assert whole["cost_usd"] == pytest.approx(0.003)
    assert whole["cost_usd_partial"] is False and whole["unpriced"] == 0
    server.cost = None  # a local server prices nothing: no cost, nothing to call partial
    unpriced = figures("unpriced")
    assert unpriced["cost_usd"] is None and unpriced["cost_usd_partial"] is False
