"""Evaluate a drafter directory on any prompt files, without a pipeline run (`aerie evaluate`).

The same measurements as the evaluate stage (`measure_setting`: lossless speculative decoding, per
prompt set x temperature x proposer x chain length), on prompt sets read from files. A file's kind is
told by its first record: MT-Bench's question format (`question_id`, `turns`), conversations (a list of
turns under `messages` or `conversations`), or single prompts (a `prompt` or `text` field).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from aerie.datasets import SourceSpec
from aerie.errors import DataError, SchemaError
from aerie.evaluate.config import EvaluateConfig, PromptSet
from aerie.evaluate.drafter_files import check_drafter_files, check_trained_for, family_of
from aerie.evaluate.prompts import prompt_set, prompt_tokenizer
from aerie.evaluate.reasoning_split import prompt_template
from aerie.evaluate.report import acceptance_by_group, acceptance_table, proposer_label
from aerie.evaluate.work import check_proposers, load_drafter_of, measure_setting, measures_drafter
from aerie.families import Family, family
from aerie.progress import ProgressFn, no_progress
from aerie.targets import TargetInfo, resolve_device, resolve_dtype

_TURN_FIELDS = {"messages": ("role", "content"), "conversations": ("from", "value")}


def prompt_set_for_file(path: str | Path, limit: int | None = None) -> PromptSet:
    """A prompt set for a JSONL or Parquet file, its kind told by the first record."""
    path = Path(path)
    name = re.sub(r"[^a-z0-9_]+", "_", path.stem.lower()).strip("_") or "prompts"
    first = _first_record(path)
    if "question_id" in first and "turns" in first:
        return PromptSet(name=name, kind="mtbench", path=str(path), limit=limit)
    for field, (role, content) in _TURN_FIELDS.items():
        turns = first.get(field)
        if isinstance(turns, list) and turns and isinstance(turns[0], dict):
            if role not in turns[0]:  # OpenAI-style turns under `conversations`, or the reverse
                role, content = ("role", "content") if "role" in turns[0] else ("from", "value")
            kind = "parquet" if path.suffix == ".parquet" else "jsonl"
            source = SourceSpec(
                kind=kind, path=str(path), messages_field=field, role_field=role, content_field=content
            )
            return PromptSet(name=name, kind="conversations", source=source, limit=limit)
    for text_field in ("prompt", "text", "question", "instruction"):
        if isinstance(first.get(text_field), str):
            return PromptSet(name=name, kind="prompts", path=str(path), text_field=text_field, limit=limit)
    raise SchemaError(
        f"{path}: cannot tell what its records hold (fields {sorted(first)}); expected MT-Bench questions "
        "(question_id, turns), conversations (messages or conversations) or prompts (prompt or text)"
    )


def _first_record(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DataError(f"prompt file {path} does not exist")
    if path.suffix == ".parquet":
        import polars as pl

        rows = pl.read_parquet(path, n_rows=1).to_dicts()
        return rows[0] if rows else {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SchemaError(f"{path}:{number}: not a JSON line ({exc.msg})") from exc
                if not isinstance(record, dict):
                    raise SchemaError(f"{path}:{number}: a record must be a JSON object")
                return record
    raise SchemaError(f"{path}: no records")


def evaluate_drafter(
    cfg: EvaluateConfig,
    target: TargetInfo,
    drafter_dir: str | Path,
    progress: ProgressFn = no_progress,
    *,
    allow_other_target: bool = False,
) -> dict[str, Any]:
    """Every (prompt set, temperature, proposer, chain length) of `cfg` on the drafter at `drafter_dir`;
    the results as the evaluate stage records them, their rows per prompt and category, and the table.
    The drafter directory is checked first (`check_drafter_files`; and that its aerie.json names this
    target and revision, unless `allow_other_target`), before the target is loaded."""
    check_drafter_files(drafter_dir)
    if not allow_other_target:
        check_trained_for(Path(drafter_dir), target.name, target.revision)
    # The drafter's family is its export's (aerie.json), listed where the default family is.
    drafting = family(family_of(Path(drafter_dir)))
    cfg = cfg.measuring(drafting.name)
    check_proposers(cfg, drafting)
    sets = cfg.prompt_sets()
    if any(s.kind == "heldout" for s in sets):
        raise DataError("a held-out split belongs to a pipeline's corpus: name prompt files instead")
    fmt = cfg.prompt_format
    tokenizer = prompt_tokenizer(target.load_tokenizer(), prompt_template(fmt), fmt.chat_template_kwargs)
    datasets = {s.name: prompt_set(tokenizer, s, cfg.max_prompt_tokens) for s in sets}
    loaded = _load(cfg, target, drafting, Path(drafter_dir))
    plan = [
        (n, t, p, k) for n in datasets for t in cfg.temperatures for p in cfg.proposers for k in cfg.num_steps
    ]
    results, per_prompt = [], []
    for i, (name, temperature, proposer, k) in enumerate(plan):
        progress(i / len(plan), f"{name} {proposer} k={k} T={temperature:g}")
        part = measure_setting(
            cfg, loaded, target, name, datasets[name], proposer, (k, temperature), lambda done: None
        )
        results.append(part["result"])
        per_prompt += part["per_prompt"]
    progress(1.0, "done")
    return {
        "drafter": str(drafter_dir),
        "target": target.name,
        "prompts": {name: len(p) for name, p in datasets.items()},
        "results": results,
        "by_group": acceptance_by_group(per_prompt),
        "table": "\n".join(acceptance_table(results)),
    }


def _load(cfg: EvaluateConfig, target: TargetInfo, drafting: Family, drafter_dir: Path) -> dict[str, Any]:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    loaded: dict[str, Any] = {"model": target.load_model(device, str(dtype).removeprefix("torch."))}
    if measures_drafter(cfg):
        loaded.update(load_drafter_of(drafting, target, drafter_dir, device, dtype))
    return loaded


def summary_lines(report: dict[str, Any]) -> list[str]:
    """One line per measurement, as the command prints them."""
    return [
        f"{r['dataset']:>12s}  {proposer_label(r):>20s}  k={r['num_steps']}  "
        f"acceptance length {r['accept_length']:.3f}  ({r['sequences']} prompts, "
        f"{r['tokens_per_second']:.1f} tokens/s)"
        for r in report["results"]
    ]
