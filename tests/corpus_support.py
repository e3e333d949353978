"""Shared pieces of the corpus tests: chat templates unlike SmolLM2's, tokenizer copies that carry them,
upstream stage results written the way the generation stage writes them, and mask helpers."""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path
from typing import Any

import polars as pl

from aerie.corpus.schema import CONVERSATIONS, TASK_COLUMNS
from aerie.manifest import StageDir, StageResult, stage_key
from aerie.store import ArtifactStore
from aerie.targets import TargetInfo, resolve_target

# Llama-3 style: bos, a system turn injected when there is none, headers, <|eot_id|>, content trimmed.
LLAMA_LIKE = (
    "{{- bos_token }}"
    "{%- if messages[0].role != 'system' -%}"
    "{{ '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023<|eot_id|>' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"
)
LLAMA_SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Qwen3 style: reasoning rendered in <think> only for assistant turns after the last user turn, so
# an earlier turn renders differently as history than when it was generated.
THINKING = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last_user and m.reasoning_content -%}"
    "{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif -%}"
    "{{ m.content + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def tokenizer_with_template(tokenizer: Any, template: str, special: list[str] | None = None) -> Any:
    """A copy of a tokenizer with another chat template (and optionally added special tokens)."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    if special:
        tok.add_tokens(special, special_tokens=True)
    return tok


def target_with_template(
    base: TargetInfo, template: str, special: list[str] | None, where: Path
) -> TargetInfo:
    """A target directory whose tokenizer carries another template: what a different model looks like to
    the corpus stage (it loads the tokenizer from the target, in every worker process)."""
    where.mkdir(parents=True, exist_ok=True)
    tokenizer_with_template(base.load_tokenizer(), template, special).save_pretrained(where)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(Path(base.path) / name, where / name)
    (where / "chat_template.jinja").write_text(template)
    return resolve_target(str(where))


def msg(role: str, content: str, reasoning: str | None = None) -> dict[str, Any]:
    return {"role": role, "content": content, "reasoning": reasoning}


def task_batch(conversations: list[list[dict[str, Any]]], **columns: list[Any]) -> pl.DataFrame:
    """Conversations as one tokenization batch (the frame the stage hands a worker)."""
    n = len(conversations)
    data = {
        "src": list(range(n)),
        "id": columns.get("id", [f"c{i}" for i in range(n)]),
        "source": columns.get("source", ["test"] * n),
        "messages": conversations,
        "truncated": columns.get("truncated", [False] * n),
        "finish_reasons": columns.get("finish_reasons", [[] for _ in range(n)]),
    }
    schema = {
        "src": pl.Int64,
        "id": pl.String,
        "source": pl.String,
        "messages": CONVERSATIONS["messages"],
        "truncated": pl.Boolean,
        "finish_reasons": pl.List(pl.String),
    }
    return pl.DataFrame(data, schema=schema).select(TASK_COLUMNS)


def generated_result(
    store: ArtifactStore, run: str, name: str, rows: list[dict[str, Any]], frame: pl.DataFrame | None = None
) -> StageResult:
    """An upstream `generate-<name>` result holding `rows` as conversations.parquet (the generation
    stage's schema), or `frame` as is (to test a schema that does not match)."""
    if frame is None:
        full = [
            {
                "finish_reasons": [],
                "prompt_tokens": 1,
                "completion_tokens": 1,
                "cost": None,
                "truncated": False,
                "params_hash": "p",
                **row,
            }
            for row in rows
        ]
        frame = pl.DataFrame(full, schema=CONVERSATIONS)
    stage_name = f"generate-{name}"
    stage = StageDir(store, run, stage_name, stage_key(stage_name, {"rows": frame.height, "name": name}))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "conversations.parquet"
        frame.write_parquet(path)
        store.put_file(stage.path("conversations.parquet"), path)
    return stage.finish({"figures": {"records": frame.height}})


def masked_runs(input_ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    """The contiguous runs of supervised tokens."""
    runs: list[list[int]] = []
    previous = 0
    for token, m in zip(input_ids, loss_mask, strict=True):
        if m and not previous:
            runs.append([])
        if m:
            runs[-1].append(token)
        previous = m
    return runs


def decoded_runs(tokenizer: Any, input_ids: list[int], loss_mask: list[int]) -> list[str]:
    return [tokenizer.decode(run) for run in masked_runs(list(input_ids), list(loss_mask))]
