"""What a run's length limits keep, before it runs: turn lengths from the datasets and the share of
supervised and of reasoning tokens that `generate...max_tokens`, `corpus.max_length` and
`train.max_length` let through.

A turn is the answer the target writes after its prompt (the conversation so far). Its tokens from
position `prompt` on are kept up to the generation cap and up to the sample limit (the smaller of the
two max_lengths): `min(answer, max_tokens, limit - prompt)`. That holds both for a conversation rendered
as one sample (the turn starts `prompt` tokens in) and for a thinking template that makes each turn its
own sample with the history before it. Answers are as long as the data's own (the sizes' assumption).

A thinking target's reasoning is not in the data, and its length is the target's: the planner gives
the share of a turn's reasoning kept when it reasons for its whole `max_tokens` (the longest turn
generation lets through, and where the training limits cut most), beside the share of the data's answers
kept. The corpus stage measures both on the real turns (`lengths` in its manifest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from aerie.config import PipelineConfig
from aerie.plan.sizes import TEMPLATE_TOKENS_PER_MESSAGE, Profile


@dataclass(frozen=True)
class LengthPlan:
    turns: int
    prompt: dict[str, int]  # tokens before a turn: p50, p99, max
    answer: dict[str, int]  # the data's answer tokens, uncapped: p50, p99, max
    max_tokens: int  # the largest generation cap of the datasets
    limit: int  # min(corpus.max_length, train.max_length)
    supervised_kept: float  # of the data-length answers' tokens
    cut_by_max_tokens: float  # share of those tokens the generation cap drops
    cut_by_max_length: float  # share the sample limit drops (of what generation kept)
    reasoning_kept: float  # of a turn that reasons for its whole max_tokens

    def record(self) -> dict[str, Any]:
        return {
            "turns": self.turns,
            "prompt_tokens": self.prompt,
            "answer_tokens": self.answer,
            "max_tokens": self.max_tokens,
            "max_length": self.limit,
            "supervised_kept_fraction": self.supervised_kept,
            "cut_by_max_tokens": self.cut_by_max_tokens,
            "cut_by_max_length": self.cut_by_max_length,
            "reasoning_kept_fraction": self.reasoning_kept,
        }

    def lines(self) -> list[str]:
        p, a = self.prompt, self.answer
        return [
            "lengths (answers as long as the data's; the merge measures the real ones)",
            f"  {self.turns:,} turns: prompt p50 {p['p50']:,} / p99 {p['p99']:,} / max {p['max']:,} tokens, "
            f"answer p50 {a['p50']:,} / p99 {a['p99']:,} / max {a['max']:,}",
            f"  limits: max_tokens {self.max_tokens:,} (generation), max_length {self.limit:,} "
            "(the smaller of corpus.max_length and train.max_length)",
            f"  supervised tokens kept: {self.supervised_kept:.1%} ({self.cut_by_max_tokens:.1%} cut by "
            f"max_tokens, {self.cut_by_max_length:.1%} by max_length)",
            f"  reasoning tokens kept: {self.reasoning_kept:.1%} of a turn that reasons for all of its "
            f"max_tokens {self.max_tokens:,} (how long the target reasons is its own: the merge reports it)",
        ]


def _spread(values: np.ndarray) -> dict[str, int]:
    if not len(values):
        return {"p50": 0, "p99": 0, "max": 0}
    p50, p99 = np.percentile(values, (50, 99), method="higher")
    return {"p50": int(p50), "p99": int(p99), "max": int(values.max())}


def estimate_lengths(cfg: PipelineConfig, profiles: list[Profile], chars_per_token: float) -> LengthPlan:
    """The turns of every dataset, their lengths and what the limits keep of them."""
    limit = min(cfg.corpus.max_length, cfg.train.max_length)
    overhead = TEMPLATE_TOKENS_PER_MESSAGE
    prompts: list[int] = []
    answers: list[int] = []
    caps: list[int] = []
    for spec, prof in zip(cfg.generate.datasets, profiles, strict=True):
        cap = spec.sampling.max_tokens
        for users, data_answers in zip(prof.user_chars, prof.answer_chars, strict=True):
            history = 0
            for i, chars in enumerate(data_answers):
                history += round(users[i] / chars_per_token) + overhead if i < len(users) else 0
                tokens = round(chars / chars_per_token) if chars is not None else cap
                prompts.append(history)
                answers.append(tokens)
                caps.append(cap if spec.regenerate else tokens)
                history += min(tokens, cap) + overhead
    prompt, answer, cap_arr = (np.asarray(x, dtype=np.int64) for x in (prompts, answers, caps))
    room = np.maximum(0, limit - prompt)
    generated = np.minimum(answer, cap_arr)
    kept = np.minimum(generated, room)
    total = max(1, int(answer.sum()))
    budget = max(1, int(cap_arr.sum()))
    return LengthPlan(
        turns=len(answer),
        prompt=_spread(prompt),
        answer=_spread(answer),
        max_tokens=max((s.sampling.max_tokens for s in cfg.generate.datasets), default=0),
        limit=limit,
        supervised_kept=round(int(kept.sum()) / total, 4),
        cut_by_max_tokens=round(int((answer - generated).sum()) / total, 4),
        cut_by_max_length=round(int((generated - kept).sum()) / total, 4),
        reasoning_kept=round(int(np.minimum(cap_arr, room).sum()) / budget, 4),
    )
