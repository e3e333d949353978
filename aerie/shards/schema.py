"""The shard schema's numbers, without torch: what the writer and reader agree on, and what a shard
costs per token (the planner sizes a run's disks with it before anything imports torch)."""

from __future__ import annotations

from typing import Literal

SHARD_SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)
STORAGE_DTYPES = ("bf16", "fp8")
Storage = Literal["bf16", "fp8"]

# Order of tensors in the data section: widest alignment first, so every tensor starts aligned to its
# element size (the header is padded to 8 bytes, sizes of later tensors keep the alignment).
TENSOR_ORDER = ("offsets", "aux_scale", "last_scale", "input_ids", "aux_hidden", "last_hidden", "loss_mask")

AUX_LAYERS = 3  # EAGLE-3's captured layers; a DFlash extraction captures its own count
SCALE_BYTES = 1  # an fp8 scale is a power of two in one byte (E8M0: `aerie.fp8.SCALE_DTYPE`)


def ids_bytes(vocab_size: int | None) -> int:
    """Bytes a shard stores a token id in: 2 (uint16) when every id of the vocabulary fits, else 4
    (int32; also when the vocabulary size is not known)."""
    return 2 if vocab_size is not None and vocab_size <= 1 << 16 else 4


def bytes_per_token(
    storage: Storage, hidden_size: int, vocab_size: int | None = None, aux_layers: int = AUX_LAYERS
) -> int:
    """Bytes one token costs in a shard (offsets, 8 bytes per sample, are left out): `aux_layers`
    captured layers and the last hidden state, each H wide."""
    ids_and_mask = ids_bytes(vocab_size) + 1
    rows = aux_layers + 1
    if storage == "bf16":
        return rows * hidden_size * 2 + ids_and_mask
    return rows * hidden_size + rows * SCALE_BYTES + ids_and_mask
