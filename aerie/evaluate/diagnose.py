"""Where acceptance is lost: the drafter's teacher-forced predictions on the target's own answers.

The EAGLE-3 measurement decodes each prompt to the target's greedy answer. Here each (prompt, answer) is
run once more through the target (its aux hidden states) and once through the drafter's training-time
test forward (`Eagle3Drafter.forward`, the code the trainer optimises), and the answer is walked in rounds
exactly as the speculative decoder walks it: the committed text ends at x_m, the drafter's last pair is
row m-1, its step k predicts x_{m+1+k}; a round accepts the longest correct prefix of its chain and the
target's bonus token, and the next round starts after them. This gives:

- the **simulated acceptance length**. Equal to the measured one, serving drafts what training taught
  (positions, aux layers, vocab map and draft cache all agree) and a low figure is a weak drafter; a gap
  is a train/serve mismatch (the ±1 layer or position errors that have cost peers acceptance silently);
- **per-token accuracy per draft step** (every answer position, not only where rounds start);
- **step-0 accuracy by position in the answer**: answers' openings are usually harder than their tails;
- the **vocabulary bound**: the simulated acceptance length had every answer token outside the draft
  vocabulary been drafted right, the most a draft vocabulary holding them all could give back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from aerie.engine.speculative.eagle import hidden_state_indices
from aerie.train.teaching import simulate_rounds

if TYPE_CHECKING:
    from aerie.draft.model import Eagle3Drafter

BUCKET = 64  # answer tokens per bucket of the by-position accuracy


@torch.no_grad()
def draft_hits(
    model: Any, drafter: Eagle3Drafter, prompt: Sequence[int], answer: Sequence[int], steps: int
) -> Tensor:
    """hits [steps, T-1] bool: the drafter's step k at row t names token t+2+k of prompt+answer (the
    answer is the target's greedy output, so that token is what verification would accept)."""
    param = next(drafter.parameters())
    ids = torch.tensor([*prompt, *answer], device=param.device)
    t = ids.shape[0]
    states = model(ids[None], output_hidden_states=True).hidden_states
    aux = torch.cat([states[i][0] for i in hidden_state_indices(drafter.config)], dim=-1).to(param.dtype)
    logits = drafter(aux, ids, torch.arange(t, device=ids.device), torch.zeros_like(ids), steps)
    hits = torch.zeros(steps, t - 1, dtype=torch.bool)
    for k, step_logits in enumerate(logits):
        n = t - 2 - k
        if n > 0:
            drafted = drafter.to_target_ids(step_logits[:n].argmax(-1))
            hits[k, :n] = (drafted == ids[2 + k :]).cpu()
    return hits


def outside_vocab(drafter: Eagle3Drafter, ids: Sequence[int], steps: int) -> Tensor:
    """[steps, T-1] bool, aligned with `draft_hits`: the token step k of row t names lies outside the
    draft vocabulary (no draft can ever be right there)."""
    outside = ~drafter.t2d.cpu()[torch.tensor(ids, dtype=torch.int64)]  # [T]
    found = torch.zeros(steps, len(ids) - 1, dtype=torch.bool)
    for k in range(steps):
        n = len(ids) - 2 - k
        if n > 0:
            found[k, :n] = outside[2 + k :]
    return found


def diagnose(
    model: Any,
    drafter: Eagle3Drafter,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    steps: int,
    max_new_tokens: int,
) -> dict[str, Any]:
    """Teacher-forced figures over (prompt, answer) pairs decoded with `max_new_tokens`; see the module
    docstring. The simulated acceptance length is defined as the decoder's: tokens after the prefill's
    per round."""
    rounds = bound_rounds = 0
    verify_tokens = 0
    step_hits = torch.zeros(steps)
    step_rows = torch.zeros(steps)
    by_position: dict[int, list[int]] = {}
    for prompt, answer in pairs:
        if len(answer) < 2:
            continue
        hits = draft_hits(model, drafter, prompt, answer, steps)
        total = len(prompt) + len(answer)
        rounds += len(simulate_rounds(hits, len(prompt), total, max_new_tokens))
        forgiven = hits | outside_vocab(drafter, [*prompt, *answer], steps)
        bound_rounds += len(simulate_rounds(forgiven, len(prompt), total, max_new_tokens))
        verify_tokens += len(answer) - 1
        rows = hits[:, len(prompt) - 1 : total - 2]  # rows whose step 0 names an answer token (from the 2nd)
        for k in range(steps):  # step k of the last k rows would name tokens past the answer
            step_hits[k] += rows[k, : max(0, rows.shape[1] - k)].sum()
            step_rows[k] += max(0, rows.shape[1] - k)
        for offset, hit in enumerate(rows[0].tolist()):
            bucket = by_position.setdefault((offset + 1) // BUCKET, [0, 0])
            bucket[0] += int(hit)
            bucket[1] += 1
    if not rounds:
        return {"rounds": 0}
    return {
        "rounds": rounds,
        "simulated_accept_length": round(verify_tokens / rounds, 4),
        "vocab_bound_accept_length": round(verify_tokens / bound_rounds, 4),
        "per_token_accuracy": [round(float(x), 4) for x in step_hits / step_rows.clamp(min=1)],
        "step0_accuracy_by_answer_position": {
            f"{b * BUCKET}-{b * BUCKET + BUCKET - 1}": round(hit / count, 4)
            for b, (hit, count) in sorted(by_position.items())
        },
    }
