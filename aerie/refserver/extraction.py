"""EAGLE-3 hidden-state capture from a packed prefill.

Two tensors per token, exactly as DESIGN.md's capture contract defines them:

- `aux_hidden [T, 3H]`: the residual stream *entering* decoder layers `aux_layers` (input convention,
  default 2, N//2, N-3 = HF `output_hidden_states[i]`), concatenated in that order. A forward pre-hook
  on each of those layers records its input, so no other layer's states are kept.
- `last_hidden [T, H]`: the base model's output, i.e. after the final norm = the input of lm_head
  (the trainer recomputes the teacher distribution from it). lm_head itself is never run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from aerie.refserver.packed import Pack, choose_backend, make_pack, packed_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class Capture:
    """One sequence's tensors, on the CPU, ready to be written."""

    input_ids: torch.Tensor  # [T] int32
    aux_hidden: torch.Tensor  # [T, len(aux_layers) * H]
    last_hidden: torch.Tensor  # [T, H]


class HiddenStateCapture:
    """Runs packed prefills of the target with capture hooks on the aux layers."""

    def __init__(self, model: PreTrainedModel, aux_layers: Sequence[int], device: str) -> None:
        self.model = model
        self.base = model.base_model
        self.layers = _decoder_layers(self.base)
        self.aux_layers = tuple(aux_layers)
        self.device = device

    def forward_pack(self, pack: Pack) -> tuple[torch.Tensor, torch.Tensor]:
        """aux [T, kH] and last [T, H] for a packed row, on the model's device."""
        captured: dict[int, torch.Tensor] = {}
        handles = [
            self.layers[i].register_forward_pre_hook(_recorder(captured, i), with_kwargs=True)
            for i in set(self.aux_layers)
        ]
        try:
            with packed_attention(self.model):
                out = self.base(
                    input_ids=pack.input_ids,
                    position_ids=pack.position_ids,
                    use_cache=False,
                    cu_seq_lens_q=pack.cu_seqlens,
                    cu_seq_lens_k=pack.cu_seqlens,
                    max_length_q=pack.max_len,
                    max_length_k=pack.max_len,
                )
        finally:
            for h in handles:
                h.remove()
        aux = torch.cat([captured[i][0] for i in self.aux_layers], dim=-1)
        return aux, out.last_hidden_state[0]

    def choose_attention(self) -> str:
        """Pick the packed-prefill kernel on a probe of two sequences (`packed.choose_backend`: the
        fused varlen kernel only where it runs and agrees with the per-sequence loop)."""
        pack = make_pack([list(range(10, 30)), list(range(40, 47))], self.device)
        with torch.inference_mode():
            return choose_backend(lambda: self.forward_pack(pack)[1])

    def capture(self, sequences: Sequence[Sequence[int]]) -> list[Capture]:
        """Prefill the sequences in one packed forward and split the states per sequence."""
        pack = make_pack(sequences, self.device)
        aux, last = self.forward_pack(pack)
        aux, last = aux.cpu(), last.cpu()  # one device->host copy per pack, then views
        ids = pack.input_ids[0].to(device="cpu", dtype=torch.int32)
        bounds = pack.cu_seqlens.tolist()
        # Row ranges of contiguous [T, ...] tensors are contiguous: the dump writer serializes the
        # views directly (a per-sample clone copied every byte of the pack once more).
        return [Capture(ids[s:e], aux[s:e], last[s:e]) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]


def _recorder(captured: dict[int, torch.Tensor], index: int) -> Any:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured[index] = args[0] if args else kwargs["hidden_states"]

    return hook


def _decoder_layers(base: torch.nn.Module) -> torch.nn.ModuleList:
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(
            f"{type(base).__name__} has no `layers` ModuleList; the reference server captures hidden "
            "states of HF decoder-only models laid out like Llama (model.layers[i])"
        )
    return layers
