"""DFlash: a block of mask tokens after an anchor, all drafted in one forward over several target
layers; the target's own embedding and head, so the target's whole vocabulary.

Parts: `aerie.draft.dflash` (model), `aerie.train.dflash_objective` (training),
`aerie.draft.dflash_export` (export, loader), `aerie.engine.speculative.dflash` (proposer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from aerie.errors import ConfigError
from aerie.families.spec import DrafterSettings, Family, Part

if TYPE_CHECKING:
    from aerie.families.protocols import TrainSettings
    from aerie.targets import TargetGeometry


class DFlashSettings(DrafterSettings):
    """The DFlash block drafter: a block of mask tokens after an anchor, all predicted in one forward."""

    family: Literal["dflash"] = "dflash"
    block_size: int = Field(
        8, ge=2, le=64, description="Tokens per block: the anchor and block_size - 1 positions drafted."
    )
    num_layers: int = Field(1, ge=1, le=8, description="Draft decoder layers.")
    num_target_layers: int = Field(
        5, ge=1, le=16, description="Target layers captured for the context features (evenly spaced)."
    )
    anchors_per_sequence: int = Field(
        512, ge=1, description="Anchors sampled per document of a packed row (fewer when it is shorter)."
    )
    mask_token_id: int | None = Field(
        None,
        ge=0,
        description="Token id filling the block after the anchor; None = the target's last vocabulary id "
        "(a rare token: its frozen embedding only has to mark the unknown positions).",
    )
    loss_decay: float = Field(
        4.0, gt=0, description="Block position j (1..block_size-1) weighs exp(-(j - 1) / loss_decay)."
    )


def spread_layers(num_layers: int, count: int) -> list[int]:
    """`count` layers evenly spaced from the output of layer 1 to that of layer N-3, DFlash's choice
    (its Qwen3-8B drafter reads [1, 9, 17, 25, 33] of 36). One layer is the middle one."""
    if count == 1:
        return [num_layers // 2]
    first, last = 1, num_layers - 3
    if last < first or count > last - first + 1:
        raise ConfigError(
            f"cannot spread {count} capture layers over a {num_layers}-layer target (outputs 1..{last})"
        )
    # Half-up rounding of the evenly spaced points, so the choice does not depend on float parity.
    return [first + int((2 * i * (last - first) + count - 1) // (2 * (count - 1))) for i in range(count)]


def _params(settings: DFlashSettings, train: TrainSettings, geometry: TargetGeometry) -> int:
    """fc over its k layers and its decoder layers (norms left out: a few H each); the embedding and
    head are the target's."""
    h, shape = geometry.hidden_size, train.draft.resolve(geometry)
    inter, heads, kv, hd = shape.intermediate_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
    attention = h * (heads + 2 * kv) * hd + heads * hd * h
    return settings.num_target_layers * h * h + settings.num_layers * (attention + 3 * h * inter)


DFLASH = Family(
    name="dflash",
    config=DFlashSettings,
    capture_layers=lambda settings, num_layers: spread_layers(num_layers, settings.num_target_layers),
    vocabulary="target",
    served_algorithm="DFLASH",
    # The deploy stage's served benchmark launches EAGLE-3 speculative decoding.
    deployable=False,
    draft_params=_params,
    model=Part("aerie.draft.dflash:DFlashDrafter"),
    objective=Part("aerie.train.dflash_objective:DFlashObjective"),
    export=Part("aerie.draft.dflash_export:export_dflash"),
    loader=Part("aerie.draft.dflash_export:load_dflash"),
    proposer=Part("aerie.engine.speculative.dflash:DFlashProposer"),
)
