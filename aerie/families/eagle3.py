"""EAGLE-3: a one-layer drafter chained step by step over three target layers, a draft vocabulary.

Its layer rule is the SGLang plugin's (`aerie.sglang_plugin.layers`: the plugin runs inside SGLang's
process with only its own package, so the one copy lives there and aerie imports it).

Parts: `aerie.draft.model` (model), `aerie.train.objective` (training), `aerie.draft.export`
(export, loader), `aerie.engine.speculative.eagle` (proposer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from aerie.families.spec import DrafterSettings, Family, Part
from aerie.sglang_plugin.layers import eagle3_layers

if TYPE_CHECKING:
    from aerie.families.protocols import TrainSettings
    from aerie.targets import TargetGeometry


class Eagle3Settings(DrafterSettings):
    """EAGLE-3's own settings, the section `train.drafter` of an EAGLE-3 run (`train.drafter.ttt_length`)."""

    family: Literal["eagle3"] = "eagle3"
    draft_vocab_size: int = Field(32000, ge=16, description="Draft vocabulary size (capped at the target's).")
    ttt_length: int = Field(7, ge=1, description="Training-time-test unroll steps.")
    step_decay: float = Field(0.8, gt=0.0, le=1.0, description="Loss weight of step k is step_decay**k.")
    init_head_from_target: bool = Field(
        True,
        description="Start lm_head from the target's lm_head rows of the draft vocab (and norm from its final norm).",
    )
    recompute: bool = Field(
        False,
        description="Activation checkpointing over the training-time-test unroll: each step's activations are "
        "recomputed in the backward instead of kept (about a third more compute, most of the unroll's memory "
        "saved); for long max_length (benchmarks/stages/long_context.py measures both).",
    )

    def vocab_rows(self, target_vocab: int) -> int:
        return min(self.draft_vocab_size, target_vocab)

    def check_training(self, train: TrainSettings) -> None:
        if train.batch_tokens < self.ttt_length + 2:
            raise ValueError(
                f"train.batch_tokens {train.batch_tokens} must be at least train.drafter.ttt_length + 2 = "
                f"{self.ttt_length + 2}: a packed batch must hold one sample of the unroll"
            )


def _params(settings: Eagle3Settings, train: TrainSettings, geometry: TargetGeometry) -> int:
    """fc, one decoder layer (its q/k/v read embeddings and hidden states together), the draft lm_head."""
    h, shape = geometry.hidden_size, train.draft.resolve(geometry)
    inter, heads, kv, hd = shape.intermediate_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
    attention = 2 * h * (heads + 2 * kv) * hd + heads * hd * h
    return 3 * h * h + attention + 3 * h * inter + h * settings.vocab_rows(geometry.vocab_size)


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
        settings.vocab_rows(geometry.vocab_size),
        seq_len,
        settings.ttt_length,
    )


EAGLE3 = Family(
    name="eagle3",
    config=Eagle3Settings,
    capture_layers=lambda settings, num_layers: eagle3_layers(num_layers),  # the SGLang plugin's rule
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
    diagnosis=Part("aerie.evaluate.diagnose:diagnose"),
)
