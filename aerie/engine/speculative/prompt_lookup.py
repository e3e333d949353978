"""Prompt-lookup speculation: the training-free proposer a drafter must beat.

The context's last n tokens are looked up earlier in the same context (prompt and output so far); the
tokens that followed their latest earlier occurrence are proposed. Longer n-grams are tried first (a
longer match predicts better), down to `min_ngram`; with no match nothing is proposed and the round is
a plain decode step. Answers that quote or restate the question, code, lists and repeated phrases are
where it pays.

An index per n maps each n-gram to the start of its latest occurrence that has a follower, updated as
tokens arrive, so a lookup is a dict probe instead of a scan of the context.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from aerie.errors import EvaluationError


class _Context:
    def __init__(self, tokens: list[int], ngrams: range) -> None:
        self.tokens: list[int] = []
        self.ngrams = ngrams
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in ngrams}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            m = len(self.tokens)  # the new token's index: n-grams ending at m-1 now have a follower
            for n in self.ngrams:
                if m >= n:
                    self.index[n][tuple(self.tokens[m - n : m])] = m - n
            self.tokens.append(int(token))

    def propose(self, k: int) -> list[int]:
        for n in reversed(self.ngrams):
            if len(self.tokens) < n:
                continue
            start = self.index[n].get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start + n : start + n + k]
        return []


class PromptLookupProposer:
    """N-gram lookup in each sequence's own context (no model, no training)."""

    name = "prompt_lookup"
    needs_aux = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise EvaluationError(
                f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}"
            )
        self.ngrams = range(min_ngram, max_ngram + 1)
        self.contexts: dict[int, _Context] = {}

    def add(self, seqs: Sequence[int], contexts: Sequence[list[int]], aux: Sequence[Tensor] | None) -> None:
        for seq, context in zip(seqs, contexts, strict=True):
            self.contexts[seq] = _Context(context, self.ngrams)

    def propose(self, seqs: Sequence[int], k: int) -> list[list[int]]:
        return [self.contexts[seq].propose(k) for seq in seqs]

    def advance(
        self, seqs: Sequence[int], new_tokens: Sequence[list[int]], aux: Sequence[Tensor] | None
    ) -> None:
        for seq, tokens in zip(seqs, new_tokens, strict=True):
            self.contexts[seq].extend(tokens)

    def remove(self, seqs: Sequence[int]) -> None:
        for seq in seqs:
            self.contexts.pop(seq, None)
