"""EAGLE-3: a one-layer drafter chained step by step over three target layers, a draft vocabulary.

Parts: `aerie.draft.model` (model), `aerie.train.objective` (training), `aerie.draft.export`
(export, loader), `aerie.engine.speculative.eagle` (proposer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from aerie.families.spec import DrafterSettings, Family, Part

if TYPE_CHECKING:
    from aerie.families.protocols import TrainSettings
    from aerie.targets import TargetGeometry


class Eagle3Settings(DrafterSettings):
    """EAGLE-3's settings beyond the training ones it shares (`train.ttt_length`, `train.draft_vocab_size`)."""

    family: Literal["eagle3"] = "eagle3"


def eagle3_layers(num_layers: int, count: int = 3) -> list[int]:
    """EAGLE-3's low, middle and high layers: outputs of 1, N//2-1 and N-4 (inputs of 2, N//2, N-3)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def _params(settings: Eagle3Settings, train: TrainSettings, geometry: TargetGeometry) -> int:
    """fc, one decoder layer (its q/k/v read embeddings and hidden states together), the draft lm_head."""
    h, shape = geometry.hidden_size, train.draft.resolve(geometry)
    inter, heads, kv, hd = shape.intermediate_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
    attention = 2 * h * (heads + 2 * kv) * hd + heads * hd * h
    return 3 * h * h + attention + 3 * h * inter + h * min(train.draft_vocab_size, geometry.vocab_size)


def ttt_flops_per_token(
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    draft_vocab: int,
    seq_len: int,
    ttt: int,
) -> float:
    """Forward+backward FLOPs per trained token (the formula benchmarks/stages/train.py reports MFU with):
    6 x matmul parameters per TTT step (fc once), plus attention over ~seq/2 causal keys."""
    layer = 2 * hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    layer += 3 * hidden * intermediate + hidden * draft_vocab
    fc = 3 * hidden * hidden
    attention = sum(4 * heads * head_dim * ((seq_len + 1) / 2 + k) for k in range(ttt))
    return 3 * (2 * (fc + ttt * layer) + attention)


def _flops(settings: Eagle3Settings, train: TrainSettings, geometry: TargetGeometry, seq_len: int) -> float:
    shape = train.draft.resolve(geometry)
    return ttt_flops_per_token(
        geometry.hidden_size,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.intermediate_size,
        min(train.draft_vocab_size, geometry.vocab_size),
        seq_len,
        train.ttt_length,
    )


EAGLE3 = Family(
    name="eagle3",
    config=Eagle3Settings,
    capture_layers=lambda settings, num_layers: eagle3_layers(num_layers),
    vocabulary="draft",
    served_algorithm="EAGLE3",
    deployable=True,
    draft_params=_params,
    train_flops=_flops,
    model=Part("aerie.draft.model:Eagle3Drafter"),
    objective=Part("aerie.train.objective:Eagle3Objective"),
    export=Part("aerie.draft.export:export_drafter"),
    loader=Part("aerie.draft.export:load_drafter"),
    proposer=Part("aerie.engine.speculative.eagle:EagleProposer"),
    diagnosed=True,
)
