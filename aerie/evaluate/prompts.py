"""The prompts acceptance is measured on: MT-Bench first turns, the corpus's held-out split, and any
prompt set a user names (`evaluate.datasets`: a file of single prompts, or multi-turn conversations).

All become token ids exactly as a server would see them: text goes through the target's chat template
with the generation prompt (the same path as the reference server's `/v1/chat/completions`); a held-out
corpus row is cut before its first supervised (assistant) token, so the prompt ends where the target's
own answer began.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aerie.datasets import MTBenchQuestion, load_conversations, load_mtbench
from aerie.errors import DataError, SchemaError

if TYPE_CHECKING:
    from aerie.evaluate.config import PromptSet
    from aerie.manifest import StageResult
    from aerie.store import ArtifactStore

MTBENCH = "mtbench"
HELDOUT = "heldout"
# Multi-step problems that make a thinking target reason at length (`PromptSet` kind `long_reasoning`).
LONG_REASONING = Path(__file__).parent / "data" / "long_reasoning.jsonl"
ALL_ROWS = 1 << 62  # a held-out set without a limit takes every eval row


@dataclass(frozen=True)
class EvalPrompt:
    id: str
    dataset: str
    input_ids: list[int]
    text: str | None = None  # the user turn, when the prompt came from text
    group: str | None = None  # MT-Bench's category: where acceptance is lost shows by category


class TemplatedTokenizer:
    """The target's tokenizer rendering chats with another template and template variables
    (`PromptFormat`: in a pipeline, the corpus's), everything else its own."""

    def __init__(self, tokenizer: Any, template: str | None, kwargs: dict[str, Any]) -> None:
        self.tokenizer, self.template, self.kwargs = tokenizer, template, dict(kwargs)

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(
            messages, **{"chat_template": self.template, **self.kwargs, **kwargs}
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


def prompt_tokenizer(tokenizer: Any, template: str | None, kwargs: dict[str, Any]) -> Any:
    """`tokenizer` itself when the target's template renders the prompts as it is."""
    return tokenizer if template is None and not kwargs else TemplatedTokenizer(tokenizer, template, kwargs)


def chat_prompt_ids(tokenizer: Any, user_text: str) -> list[int]:
    """One user turn through the chat template, tokenized as the reference server's chat endpoint does."""
    return chat_ids(tokenizer, [{"role": "user", "content": user_text}])


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """A conversation ending in a user turn, through the chat template with the generation prompt."""
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return [int(t) for t in tokenizer(str(rendered), add_special_tokens=False).input_ids]


def _clip(ids: list[int], max_tokens: int) -> list[int]:
    # The end of a prompt (the generation prompt) decides what comes next: keep the last tokens.
    return ids[-max_tokens:]


def mtbench_prompts(
    tokenizer: Any, limit: int | None, max_tokens: int, *, path: str | None = None, name: str = MTBENCH
) -> list[EvalPrompt]:
    """First turns of the MT-Bench questions (the packaged file, or `path` in its format), in file
    order: all when `limit` is None, else `limit` of them spread over the categories
    (`spread_over_categories`)."""
    questions = load_mtbench(path)
    if limit is not None:
        questions = spread_over_categories(questions, limit)
    return [
        EvalPrompt(
            q.id, name, _clip(chat_prompt_ids(tokenizer, q.turns[0]), max_tokens), q.turns[0], q.category
        )
        for q in questions
    ]


def file_prompts(tokenizer: Any, spec: PromptSet, max_tokens: int) -> list[EvalPrompt]:
    """Single prompts from a JSONL or Parquet file: `spec.text_field` (required in every record), with
    an id and a category where the file has them. An evaluation set must be complete: a bad record
    raises, naming the file and its line (row)."""
    assert spec.path is not None  # checked when the config loaded
    prompts: list[EvalPrompt] = []
    for where, record in _records(Path(spec.path)):
        text = record.get(spec.text_field) if isinstance(record, dict) else None
        if not isinstance(text, str) or not text.strip():
            found = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise SchemaError(f"{where}: no prompt text in field {spec.text_field!r} (found {found})")
        pid = record.get(spec.id_field) if spec.id_field else None
        group = record.get(spec.category_field) if spec.category_field else None
        prompts.append(
            EvalPrompt(
                f"{spec.name}-{pid if pid is not None else len(prompts)}",
                spec.name,
                _clip(chat_prompt_ids(tokenizer, text), max_tokens),
                text,
                None if group is None else str(group),
            )
        )
        if spec.limit is not None and len(prompts) >= spec.limit:
            break
    if not prompts:
        raise SchemaError(f"{spec.path}: no prompts")
    return prompts


def _records(path: Path) -> list[tuple[str, Any]]:
    if not path.is_file():
        raise DataError(f"prompt file {path} does not exist")
    if path.suffix == ".parquet":
        import polars as pl

        try:
            rows = pl.read_parquet(path).to_dicts()
        except Exception as exc:  # polars raises many kinds for a damaged file
            raise SchemaError(f"{path}: not a readable Parquet file: {exc}") from exc
        return [(f"{path} row {i}", row) for i, row in enumerate(rows)]
    records = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append((f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise SchemaError(f"{path}:{number}: not a JSON line ({exc.msg})") from exc
    return records


def conversation_prompts(tokenizer: Any, spec: PromptSet, max_tokens: int) -> list[EvalPrompt]:
    """Multi-turn prompts: each user turn of each conversation (or only the first, `turns="first"`)
    with the conversation before it as the file has it, the target answering that turn."""
    assert spec.source is not None  # checked when the config loaded
    conversations, report = load_conversations(spec.source, spec.name)
    if report.skipped:
        raise SchemaError(f"prompt set {spec.name!r}: records skipped {report.skipped}: {report.examples}")
    prompts: list[EvalPrompt] = []
    for conv in conversations:
        history: list[dict[str, str]] = []
        for turn, message in enumerate(conv.messages):
            history.append({"role": message.role, "content": message.content})
            if message.role != "user":
                continue
            ids = _clip(chat_ids(tokenizer, history), max_tokens)
            prompts.append(EvalPrompt(f"{conv.id}-t{turn}", spec.name, ids, message.content))
            if spec.limit is not None and len(prompts) >= spec.limit:
                return prompts
            if spec.turns == "first":
                break
    if not prompts:
        raise SchemaError(
            f"prompt set {spec.name!r}: no user turns in {spec.source.path or spec.source.kind}"
        )
    return prompts


def spread_over_categories(questions: list[MTBenchQuestion], limit: int) -> list[MTBenchQuestion]:
    """`limit` questions taken round-robin over the categories (each category's in file order), returned
    in file order. The file lists its 80 questions by category, ten each, so its first 8 are all
    "writing"; here 8 questions are one of each category and a small evaluation measures the whole
    benchmark, not its first category."""
    by_category: dict[str, list[int]] = {}
    for index, q in enumerate(questions):
        by_category.setdefault(q.category, []).append(index)
    picked: list[int] = []
    for rank in range(max((len(v) for v in by_category.values()), default=0)):
        picked += [indices[rank] for indices in by_category.values() if rank < len(indices)]
    return [questions[i] for i in sorted(picked[:limit])]


def prompt_set(tokenizer: Any, spec: PromptSet, max_tokens: int) -> list[EvalPrompt]:
    """The prompts of a set that is not the corpus's held-out split (see `EvaluateConfig.datasets`)."""
    if spec.kind == "mtbench":
        return mtbench_prompts(tokenizer, spec.limit, max_tokens, path=spec.path, name=spec.name)
    if spec.kind == "prompts":
        return file_prompts(tokenizer, spec, max_tokens)
    if spec.kind == "long_reasoning":
        return file_prompts(
            tokenizer, spec.model_copy(update={"path": spec.path or str(LONG_REASONING)}), max_tokens
        )
    if spec.kind == "conversations":
        return conversation_prompts(tokenizer, spec, max_tokens)
    raise DataError(f"prompt set {spec.name!r}: kind {spec.kind!r} is read from the corpus, not a file")


def heldout_prompts(
    store: ArtifactStore, corpus: StageResult, limit: int, max_tokens: int, name: str = HELDOUT
) -> tuple[list[EvalPrompt], dict[str, int]]:
    """Up to `limit` rows of the corpus's eval split, each cut before its first supervised token.
    Returns the prompts and counts of rows passed over (no supervised token / nothing before it)."""
    from aerie.corpus import iter_corpus

    prompts: list[EvalPrompt] = []
    skipped = {"no_supervised_token": 0, "empty_prefix": 0}
    if limit <= 0:
        return prompts, skipped
    try:
        rows = iter_corpus(store, corpus, "eval")
        for row in rows:
            try:
                first = list(row.loss_mask).index(1)
            except ValueError:
                skipped["no_supervised_token"] += 1
                continue
            if first == 0:
                skipped["empty_prefix"] += 1
                continue
            prompts.append(EvalPrompt(row.id, name, _clip(list(row.input_ids[:first]), max_tokens)))
            if len(prompts) >= limit:
                break
    except DataError:
        raise
    except Exception as exc:  # polars/IO errors reading a shard: say which corpus
        raise DataError(f"cannot read the eval split of corpus {corpus.prefix}: {exc}") from exc
    return prompts, skipped
