"""Token generation behind one small interface, so speculative decoding can replace the plain one.

`GenerationBackend` is the seam: the scheduler admits requests (prefill) and steps the running batch
(decode) and never looks inside. `BatchedDecoder` is the plain implementation: greedy or sampled
decoding of a left-padded batch with a KV cache, where requests join a running batch between steps
(their caches are left-padded to a common length and concatenated) and leave it as soon as they
finish — continuous batching without paged memory. `aerie.engine.speculative.decoder` may provide an
EAGLE-3 backend with the same interface (see `aerie.engine.server.lifecycle.build_backend`).

Correctness rule (tested): a greedy request gives the same tokens in a batch as alone. Left padding
with an attention mask and per-row positions (cumsum of the mask) makes padded rows exact up to
floating-point summation order.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of decoding (SGLang's `sampling_params` subset the server implements)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1


# Called on the model thread after each step a streamed request took part in: its tokens so far and
# the meta_info fields that come with them (a speculative backend's spec_verify_ct so far).
TokenSink = Callable[[list[int], dict[str, Any]], None]


@dataclass(frozen=True)
class GenRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    stream: TokenSink | None = field(default=None, compare=False)


@dataclass
class GenResult:
    """A finished request. `finish_reason` is SGLang's dict: {"type": "length", "length": n} or
    {"type": "stop", "matched": token id or stop string}; `meta` is merged into `meta_info`."""

    request: GenRequest
    output_ids: list[int]
    finish_reason: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)


class GenerationBackend(Protocol):
    """Prefill-and-decode engine driven by the scheduler's single worker thread."""

    @property
    def num_running(self) -> int: ...

    def can_admit(self, request: GenRequest, admitting: int, admitting_tokens: int) -> bool:
        """Whether `request` may join now, given `admitting` requests (`admitting_tokens` prompt
        tokens) already chosen for this admission round."""
        ...

    def admit(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Prefill the requests into the running batch; return those already finished."""
        ...

    def step(self) -> list[GenResult]:
        """One decoding step of every running request; return those that finished."""
        ...

    def abort_all(self) -> list[GenRequest]:
        """Drop every running request (after a failed step); return them."""
        ...

    def partial(self) -> list[tuple[GenRequest, list[int], dict[str, Any]]]:
        """Every running request with its tokens so far and their meta_info fields (for streaming)."""
        ...


@dataclass
class _Row:
    request: GenRequest
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    stop_text_tokens: int = 0  # how many trailing tokens to decode when looking for stop strings


class BatchedDecoder:
    """The plain backend: batched greedy/sampling decoding with a shared, left-padded KV cache."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None,
        *,
        eos_token_ids: Sequence[int],
        device: str,
        max_running: int,
        max_prefill_tokens: int,
        seed: int | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.device = device
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.generator = torch.Generator(device=device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        self.pad_id = next(iter(sorted(self.eos)), 0)
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self.rows: list[_Row] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [B, L] 1 = real token
        self.next_ids: torch.Tensor | None = None  # [B] the token to feed at the next step

    @property
    def num_running(self) -> int:
        return len(self.rows)

    def partial(self) -> list[tuple[GenRequest, list[int], dict[str, Any]]]:
        return [(row.request, list(row.output_ids), {}) for row in self.rows]

    def can_admit(self, request: GenRequest, admitting: int, admitting_tokens: int) -> bool:
        if self.num_running + admitting >= self.max_running:
            return False
        if admitting and admitting_tokens + len(request.input_ids) > self.max_prefill_tokens:
            return False
        # Joining a running batch pads and concatenates plain (non sliding-window) cache layers only.
        return not self.rows or _mergeable(self.cache)

    def admit(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        if not requests:
            return []
        rows = [self._new_row(r) for r in requests]
        cache, mask, logits = self._prefill([r.input_ids for r in requests])
        tokens = self._sample(logits, rows)
        first = len(self.rows)
        if self.rows:
            assert self.mask is not None
            self.cache, self.mask = _merge(self.cache, self.mask, cache, mask)
            assert self.next_ids is not None
            self.next_ids = torch.cat([self.next_ids, tokens])
        else:
            self.cache, self.mask, self.next_ids = cache, mask, tokens
        self.rows.extend(rows)
        return self._record(tokens, first)

    def step(self) -> list[GenResult]:
        if not self.rows:
            return []
        assert self.mask is not None and self.next_ids is not None
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        positions = self.mask.sum(dim=1, keepdim=True) - 1
        out = self.model(
            input_ids=self.next_ids[:, None],
            attention_mask=self.mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: self.cache},
        )
        tokens = self._sample(out.logits[:, -1, :], self.rows)
        self.next_ids = tokens
        return self._record(tokens, 0)

    def abort_all(self) -> list[GenRequest]:
        dropped = [r.request for r in self.rows]
        self.rows, self.cache, self.mask, self.next_ids = [], None, None, None
        return dropped

    # -- internals -------------------------------------------------------------------------------

    def _new_row(self, request: GenRequest) -> _Row:
        gen = None
        if request.params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(request.params.seed)
        longest_stop = max((len(s) for s in request.params.stop), default=0)
        return _Row(request, generator=gen, stop_text_tokens=longest_stop + 2 if longest_stop else 0)

    def _prefill(self, prompts: Sequence[list[int]]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        from transformers import DynamicCache

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: the last column is every row's last token
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kw: cache},
        )
        return cache, mask, out.logits[:, -1, :]

    def _sample(self, logits: torch.Tensor, rows: Sequence[_Row]) -> torch.Tensor:
        logits = logits.float()
        self._suppress_early_stops(logits, rows)
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.request.params.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            probs = _filtered_probs(logits[idx], [rows[i].request.params for i in sampled])
            picks = [
                torch.multinomial(probs[j], 1, generator=rows[i].generator or self.generator)
                for j, i in enumerate(sampled)
            ]
            tokens[idx] = torch.cat(picks)
        return tokens

    def _suppress_early_stops(self, logits: torch.Tensor, rows: Sequence[_Row]) -> None:
        for i, row in enumerate(rows):
            p = row.request.params
            if len(row.output_ids) < p.min_new_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos))
                logits[i, banned] = float("-inf")

    def _record(self, tokens: torch.Tensor, first: int) -> list[GenResult]:
        """Append the new token of rows[first:], then drop the finished rows from the batch."""
        finished: list[GenResult] = []
        keep = list(range(first))
        for i, tok in enumerate(tokens.tolist(), start=first):
            row = self.rows[i]
            row.output_ids.append(tok)
            reason = self._finish_reason(row, tok)
            if reason is None:
                keep.append(i)
            else:
                finished.append(GenResult(row.request, row.output_ids, reason))
        if len(keep) < len(self.rows):
            self._keep_rows(keep)
        return finished

    def _finish_reason(self, row: _Row, tok: int) -> dict[str, Any] | None:
        p = row.request.params
        n = len(row.output_ids)
        if n >= p.max_new_tokens:
            return {"type": "length", "length": n}
        if n < p.min_new_tokens:
            return None
        if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if p.stop and self.tokenizer is not None:
            tail = self.tokenizer.decode(row.output_ids[-row.stop_text_tokens :])
            for s in p.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        return None

    def _keep_rows(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.mask, self.next_ids = None, None, None
            return
        assert self.mask is not None and self.next_ids is not None
        index = torch.tensor(keep, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.next_ids = self.next_ids[index]
        # Columns that are padding for every remaining row are dead weight in every later step.
        first = int(self.mask.any(dim=0).nonzero()[0])
        if first and _mergeable(self.cache):
            self.mask = self.mask[:, first:]
            _trim_left(self.cache, first)


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p per row, in one sort."""
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[-1] for p in params], device=dev)[:, None]
    min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
    values, order = (logits / temp).sort(dim=-1, descending=True)
    probs = values.softmax(dim=-1)
    ranks = torch.arange(values.shape[-1], device=dev)[None, :]
    drop = (probs.cumsum(dim=-1) - probs > top_p) | (ranks >= top_k) | (probs < min_p * probs[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    values = values.masked_fill(drop, float("-inf"))
    out = torch.zeros_like(logits)
    out.scatter_(-1, order, values.softmax(dim=-1))
    return out


def _layers(cache: Any) -> list[Any]:
    return list(getattr(cache, "layers", []))


def _mergeable(cache: Any) -> bool:
    from transformers.cache_utils import DynamicLayer

    layers = _layers(cache)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _trim_left(cache: Any, n: int) -> None:
    for layer in _layers(cache):
        if layer.is_initialized:
            layer.keys = layer.keys[:, :, n:, :]
            layer.values = layer.values[:, :, n:, :]


def _pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _merge(
    cache_a: Any, mask_a: torch.Tensor, cache_b: Any, mask_b: torch.Tensor
) -> tuple[Any, torch.Tensor]:
    """Concatenate two left-padded batches: pad the shorter on the left (masked zeros), stack rows."""
    pad_a = max(mask_b.shape[1] - mask_a.shape[1], 0)
    pad_b = max(mask_a.shape[1] - mask_b.shape[1], 0)
    for la, lb in zip(_layers(cache_a), _layers(cache_b), strict=True):
        la.keys = torch.cat([_pad_left(la.keys, pad_a, 2), _pad_left(lb.keys, pad_b, 2)], dim=0)
        la.values = torch.cat([_pad_left(la.values, pad_a, 2), _pad_left(lb.values, pad_b, 2)], dim=0)
    mask = torch.cat([_pad_left(mask_a, pad_a, 1), _pad_left(mask_b, pad_b, 1)], dim=0)
    return cache_a, mask


class RunToCompletionBackend:
    """Adapts a batch decoder that runs its prompts to the end (e.g. speculative decoding) to
    `GenerationBackend`: `admit` decodes the admitted requests completely, `step` has nothing to do.

    `run(requests)` returns one GenResult per request, in order. Requests that arrive while a batch
    runs wait for the next one (no joining mid-flight).
    """

    def __init__(self, run: Callable[[Sequence[GenRequest]], list[GenResult]], *, max_batch: int) -> None:
        self.run = run
        self.max_batch = max_batch

    @property
    def num_running(self) -> int:
        return 0

    def can_admit(self, request: GenRequest, admitting: int, admitting_tokens: int) -> bool:
        return admitting < self.max_batch

    def admit(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        results = self.run(requests)
        if len(results) != len(requests):
            raise RuntimeError(f"the backend returned {len(results)} results for {len(requests)} requests")
        return results

    def step(self) -> list[GenResult]:
        return []

    def abort_all(self) -> list[GenRequest]:
        return []

    def partial(self) -> list[tuple[GenRequest, list[int], dict[str, Any]]]:
        return []  # a request's tokens come all at once, with its result
