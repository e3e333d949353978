"""The prompts acceptance is measured on: MT-Bench first turns and the corpus's held-out split.

Both become token ids exactly as a server would see them: MT-Bench questions go through the target's
chat template with the generation prompt (the same path as the reference server's
`/v1/chat/completions`); a held-out corpus row is cut before its first supervised (assistant) token, so
the prompt ends where the target's own answer began.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aerie.datasets import MTBenchQuestion, load_mtbench
from aerie.errors import DataError

if TYPE_CHECKING:
    from aerie.manifest import StageResult
    from aerie.store import ArtifactStore

MTBENCH = "mtbench"
HELDOUT = "heldout"


@dataclass(frozen=True)
class EvalPrompt:
    id: str
    dataset: str
    input_ids: list[int]
    text: str | None = None  # the user turn, when the prompt came from text
    group: str | None = None  # MT-Bench's category: where acceptance is lost shows by category


def chat_prompt_ids(tokenizer: Any, user_text: str) -> list[int]:
    """One user turn through the chat template, tokenized as the reference server's chat endpoint does."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text}], add_generation_prompt=True, tokenize=False
    )
    return [int(t) for t in tokenizer(str(rendered), add_special_tokens=False).input_ids]


def _clip(ids: list[int], max_tokens: int) -> list[int]:
    # The end of a prompt (the generation prompt) decides what comes next: keep the last tokens.
    return ids[-max_tokens:]


def mtbench_prompts(tokenizer: Any, limit: int | None, max_tokens: int) -> list[EvalPrompt]:
    """First turns of the MT-Bench questions, in file order: all 80 when `limit` is None, else `limit` of
    them spread over the categories (`spread_over_categories`)."""
    questions = load_mtbench()
    if limit is not None:
        questions = spread_over_categories(questions, limit)
    return [
        EvalPrompt(
            q.id, MTBENCH, _clip(chat_prompt_ids(tokenizer, q.turns[0]), max_tokens), q.turns[0], q.category
        )
        for q in questions
    ]


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


def heldout_prompts(
    store: ArtifactStore, corpus: StageResult, limit: int, max_tokens: int
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
            prompts.append(EvalPrompt(row.id, HELDOUT, _clip(list(row.input_ids[:first]), max_tokens)))
            if len(prompts) >= limit:
                break
    except DataError:
        raise
    except Exception as exc:  # polars/IO errors reading a shard: say which corpus
        raise DataError(f"cannot read the eval split of corpus {corpus.prefix}: {exc}") from exc
    return prompts, skipped
