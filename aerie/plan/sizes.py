"""How much a run handles: conversations, turns, prompt and completion tokens, corpus tokens.

Counted from the datasets themselves (the loader and the turn selection the generation stage uses), with
token counts from characters: the target's own tokenizer measures characters per token on a sample of
the conversations where it is on this machine, else an assumed ratio is used (and printed). The
target's answers do not exist before generation: each is taken to be as long as the data's own answer
at that turn, capped at `max_tokens`. A profile of each dataset is cached by the source's sha256, so a
second plan of the same data reads a few kilobytes instead of the whole source.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from aerie.config import PipelineConfig
from aerie.generate.config import DatasetSpec
from aerie.plan.facts import TargetFacts

# Chat-template tokens around one message (role markers, end of turn); SmolLM2's ChatML spends 5.
TEMPLATE_TOKENS_PER_MESSAGE = 5
# Characters per token where the target's tokenizer is not on this machine (English-heavy chat data
# under a ~160K-vocabulary BPE).
ASSUMED_CHARS_PER_TOKEN = 4.0
# Conversations tokenized to measure characters per token.
TOKENIZER_SAMPLE = 200
# Characters of each sampled conversation tokenized (enough for a stable ratio, and fast).
SAMPLE_CHARS = 4000
# Every this-many-th conversation is a candidate for that sample (one pass over the source).
SAMPLE_EVERY = 20


@dataclass
class Profile:
    """Characters of each conversation's user turns and of the data's answers, slot by slot."""

    user_chars: list[list[int]] = field(default_factory=list)
    answer_chars: list[list[int | None]] = field(default_factory=list)
    sample_text: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class DatasetSize:
    name: str
    conversations: int
    turns: int
    prompt_tokens: int
    completion_tokens: int
    regenerate: bool
    max_tokens: int


@dataclass(frozen=True)
class Sizes:
    datasets: list[DatasetSize]
    corpus_records: int
    corpus_tokens: int
    supervised_tokens: int
    train_tokens: int
    eval_tokens: int
    eval_records: int  # the held-out split, which also bounds the evaluation's held-out prompts
    chars_per_token: float
    chars_per_token_source: str
    profiles: list[Profile] = field(default_factory=list, repr=False)  # what the lengths are read from

    @property
    def conversations(self) -> int:
        return sum(d.conversations for d in self.datasets)

    @property
    def turns(self) -> int:
        return sum(d.turns for d in self.datasets)

    @property
    def prompt_tokens(self) -> int:
        return sum(d.prompt_tokens for d in self.datasets if d.regenerate)

    @property
    def completion_tokens(self) -> int:
        return sum(d.completion_tokens for d in self.datasets if d.regenerate)


def _cache_file(spec: DatasetSpec) -> Path | None:
    from aerie.datasets import source_fingerprint
    from aerie.settings import get_settings

    fingerprint = source_fingerprint(spec.source)
    if fingerprint is None:
        return None
    key = json.dumps(
        [
            fingerprint,
            spec.source.model_dump(mode="json"),
            spec.num_samples,
            spec.max_turns,
            spec.system_prompt,
        ],
        sort_keys=True,
    )
    return get_settings().cache_dir / "plan" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def profile(spec: DatasetSpec) -> Profile:
    """The dataset's profile, read through the same loader and turn selection as the generation stage."""
    cached = _cache_file(spec)
    if cached is not None and cached.is_file():
        data = json.loads(cached.read_text())
        return Profile(data["user_chars"], data["answer_chars"], data["sample_text"])
    from aerie.datasets import iter_conversations
    from aerie.generate.turns import prepare

    out = Profile()
    texts: list[str] = []
    for conversation in iter_conversations(spec.source, spec.name, limit=spec.num_samples):
        prepared = prepare(conversation, spec)
        if isinstance(prepared, str):
            continue
        users = [len(m.content) for m in prepared.messages if m.role != "assistant"]
        slots = sum(1 for m in prepared.messages if m.role == "assistant")
        answers: list[int | None] = [len(m.content) for m in conversation.messages if m.role == "assistant"]
        out.user_chars.append(users)
        out.answer_chars.append((answers + [None] * slots)[:slots])
        if len(out.user_chars) % SAMPLE_EVERY == 1 or SAMPLE_EVERY == 1:
            texts.append("\n".join(m.content for m in conversation.messages)[:SAMPLE_CHARS])
    out.sample_text = texts[:: max(1, len(texts) // TOKENIZER_SAMPLE)][:TOKENIZER_SAMPLE]
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(
            json.dumps(
                {
                    "user_chars": out.user_chars,
                    "answer_chars": out.answer_chars,
                    "sample_text": out.sample_text,
                }
            )
        )
    return out


def chars_per_token(target: TargetFacts, profiles: list[Profile]) -> tuple[float, str]:
    """Characters per token of the target's tokenizer on the datasets' text, and where the figure is from
    (cached by the tokenizer's and the sample's digests)."""
    text = [t for p in profiles for t in p.sample_text]
    if target.tokenizer_path is None or not text:
        return ASSUMED_CHARS_PER_TOKEN, f"assumed ({target.name}'s tokenizer is not on this machine)"
    from aerie.settings import get_settings

    digest = hashlib.sha256(Path(target.tokenizer_path).read_bytes())
    digest.update("\0".join(text).encode())
    cached = get_settings().cache_dir / "plan" / f"ratio-{digest.hexdigest()[:20]}.json"
    if cached.is_file():
        ratio = float(json.loads(cached.read_text()))
    else:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(target.tokenizer_path)
        tokens = sum(len(e.ids) for e in tokenizer.encode_batch(text, add_special_tokens=False))
        ratio = sum(len(t) for t in text) / max(1, tokens)
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(ratio))
    return ratio, f"measured with the target's tokenizer on {len(text)} sampled conversations"


def estimate(cfg: PipelineConfig, target: TargetFacts) -> Sizes:
    """Every dataset's and the corpus's sizes under this config."""
    profiles = [profile(spec) for spec in cfg.generate.datasets]
    ratio, ratio_source = chars_per_token(target, profiles)
    overhead = TEMPLATE_TOKENS_PER_MESSAGE
    datasets: list[DatasetSize] = []
    records = corpus_tokens = supervised = 0
    for spec, prof in zip(cfg.generate.datasets, profiles, strict=True):
        cap = spec.sampling.max_tokens
        prompt = completion = turns = 0
        for users, answers in zip(prof.user_chars, prof.answer_chars, strict=True):
            user_tokens = [round(u / ratio) + overhead for u in users]
            answer_tokens = [
                (min(cap, round(a / ratio)) if a is not None else cap)
                if spec.regenerate
                else round((a or 0) / ratio)
                for a in answers
            ]
            history = 0
            for i, answer in enumerate(answer_tokens):
                history += user_tokens[i] if i < len(user_tokens) else 0
                prompt += history
                history += answer + overhead
            completion += sum(answer_tokens)
            turns += len(answer_tokens)
            total = sum(user_tokens) + sum(answer_tokens) + overhead * len(answer_tokens)
            kept = min(total, cfg.corpus.max_length)
            records += 1
            corpus_tokens += kept
            supervised += round(sum(answer_tokens) * kept / max(1, total))
        datasets.append(
            DatasetSize(spec.name, len(prof.user_chars), turns, prompt, completion, spec.regenerate, cap)
        )
    eval_tokens = round(corpus_tokens * cfg.corpus.eval_fraction)
    train_tokens = round((corpus_tokens - eval_tokens) * cfg.train.train_fraction * cfg.train.epochs)
    return Sizes(
        datasets=datasets,
        corpus_records=records,
        corpus_tokens=corpus_tokens,
        supervised_tokens=supervised,
        train_tokens=train_tokens,
        eval_tokens=eval_tokens,
        eval_records=round(records * cfg.corpus.eval_fraction),
        chars_per_token=ratio,
        chars_per_token_source=ratio_source,
        profiles=profiles,
    )
