"""The reference server's speculative mode: `--speculative-algorithm ALGO
--speculative-draft-model-path DIR --speculative-num-steps K`, ALGO a drafter family's
(`Family.served_algorithm`: EAGLE3, DFLASH or a plug-in's).

Greedy requests are decoded by `SpecDecoder` with the family's proposer over its drafter, continuously batched (requests
join between rounds), and report SGLang's speculative fields in `meta_info`: `spec_verify_ct`,
`spec_accept_length` (= completion_tokens / spec_verify_ct), `spec_accept_token_num` (accepted drafts)
and `spec_draft_token_num` (drafts verified). What the decoder does not do — sampling, stop strings,
`min_new_tokens` — goes to the plain batched decoder, so every request is still served.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aerie.engine.generation import BatchedDecoder, GenRequest, GenResult
from aerie.engine.speculative.decoder import SpecDecoder, SpecOutput
from aerie.families import serving

DEFAULT_NUM_STEPS = 3


def speculative_fits(request: GenRequest) -> bool:
    """Whether the lossless greedy decoder can serve this request exactly as the plain one would."""
    p = request.params
    return p.greedy and not p.stop and p.min_new_tokens == 0


class SpeculativeBackend:
    """`aerie.engine.generation.GenerationBackend` with speculative decoding for greedy requests."""

    def __init__(
        self,
        decoder: SpecDecoder,
        plain: BatchedDecoder,
        *,
        eos_token_ids: Sequence[int],
        max_running: int,
        max_prefill_tokens: int,
    ) -> None:
        self.decoder = decoder
        self.plain = plain
        self.eos = frozenset(int(e) for e in eos_token_ids)
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.requests: dict[int, GenRequest] = {}  # decoder sequence id -> request

    @classmethod
    def from_server(cls, loaded: Any, args: Any) -> SpeculativeBackend:
        """Build from the reference server's loaded model and parsed args (loads the drafter with the
        loader of the family `--speculative-algorithm` names)."""
        from aerie.targets import resolve_target

        drafting = serving(args.speculative_algorithm)
        target = resolve_target(args.model_path)
        load = drafting.loader.load()
        drafter = load(args.speculative_draft_model_path, target, device=loaded.device, dtype=loaded.dtype)
        proposer = drafting.proposer.load()(drafter)
        decoder = SpecDecoder(
            loaded.model,
            proposer,
            num_steps=args.speculative_num_steps or DEFAULT_NUM_STEPS,
            eos_token_ids=loaded.eos_token_ids,
            aux_layers=proposer.aux_layers,
        )
        plain = BatchedDecoder(
            loaded.model,
            loaded.tokenizer,
            eos_token_ids=loaded.eos_token_ids,
            device=loaded.device,
            max_running=args.max_running_requests,
            max_prefill_tokens=args.max_batch_tokens,
            seed=args.random_seed,
        )
        return cls(
            decoder,
            plain,
            eos_token_ids=loaded.eos_token_ids,
            max_running=args.max_running_requests,
            max_prefill_tokens=args.max_batch_tokens,
        )

    @property
    def num_running(self) -> int:
        return self.decoder.num_running + self.plain.num_running

    def can_admit(self, request: GenRequest, admitting: int, admitting_tokens: int) -> bool:
        if not speculative_fits(request):
            return self.plain.can_admit(request, admitting, admitting_tokens)
        if self.num_running + admitting >= self.max_running:
            return False
        return not admitting or admitting_tokens + len(request.input_ids) <= self.max_prefill_tokens

    def admit(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        spec = [r for r in requests if speculative_fits(r)]
        finished = self.plain.admit([r for r in requests if not speculative_fits(r)])
        if spec:
            seqs, done = self.decoder.admit(
                [r.input_ids for r in spec],
                [r.params.max_new_tokens for r in spec],
                [self._stops(r) for r in spec],
            )
            self.requests.update(zip(seqs, spec, strict=True))
            finished += [self._result(seq, out) for seq, out in done]
        return finished

    def step(self) -> list[GenResult]:
        finished = [self._result(seq, out) for seq, out in self.decoder.step()]
        if self.plain.num_running:
            finished += self.plain.step()
        return finished

    def abort_all(self) -> list[GenRequest]:
        dropped = [self.requests.pop(seq) for seq in self.decoder.abort_all() if seq in self.requests]
        return dropped + self.plain.abort_all()

    def partial(self) -> list[tuple[GenRequest, list[int], dict[str, Any]]]:
        spec = [
            (self.requests[row.seq], list(row.generated), {"spec_verify_ct": row.verify_ct})
            for row in self.decoder.rows
            if row.seq in self.requests
        ]
        return spec + self.plain.partial()

    def _stops(self, request: GenRequest) -> frozenset[int]:
        p = request.params
        return frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos)

    def _result(self, seq: int, out: SpecOutput) -> GenResult:
        request = self.requests.pop(seq)
        n = out.completion_tokens
        if out.finish_reason == "stop":
            reason: dict[str, Any] = {"type": "stop", "matched": out.output_ids[-1]}
        else:
            reason = {"type": "length", "length": n}
        meta = {
            "spec_verify_ct": out.verify_ct,
            "spec_accept_length": out.spec_accept_length,
            "spec_accept_token_num": sum(out.accepted),
            "spec_draft_token_num": sum(out.reached),
        }
        return GenResult(request, list(out.output_ids), reason, meta)


def create_backend(loaded: Any, args: Any) -> Any:
    """The reference server's speculative seam (`aerie.engine.server.lifecycle.build_backend`): a
    `GenerationBackend` serving greedy requests through `SpecDecoder` with the EAGLE-3 drafter of
    `--speculative-draft-model-path`."""
    return SpeculativeBackend.from_server(loaded, args)
