"""Hidden-state shards: the format extraction writes and training reads.

Peers write one file per sample (millions of small files, a `torch.load` per step). aerie packs samples
into append-only shards instead, so training reads contiguous token ranges and the store holds a few
hundred objects. One shard holds::

    offsets     int64        [S+1]   sample i is tokens offsets[i]:offsets[i+1]
    input_ids   uint16|int32 [N]     uint16 when the target's vocabulary fits in it
    loss_mask   uint8        [N]
    aux_hidden  bf16|fp8     [N, kH] residual stream entering the k captured layers, concatenated
                                     (EAGLE-3: k = 3; DFlash: its config's layer list)
    last_hidden bf16|fp8     [N, H]  after the final norm (the target lm_head's input)
    aux_scale   uint8        [N, k]  fp8 only: one power-of-two scale per token per captured layer
    last_scale  uint8        [N, 1]  fp8 only

fp8 is float8_e4m3fn with a per-token (per layer) absmax scale: the residual stream's magnitude grows
with depth and varies a lot between tokens (attention sinks), so one scale per tensor would crush the
small ones. e4m3 keeps 3 mantissa bits: every element is within 2^-4 of its own magnitude. A scale is
a power of two in one byte (E8M0), so a token costs (k+1)(H + 1) bytes of states against bf16's 2(k+1)H. The
scheme lives in `aerie.fp8`: the client quantizes with it, or the reference server already did
(`extract.quantize_on_server`) and the writer stores its codes and scales as they are.

Schema version 1 (float32 scales, int32 ids) is still read.

The safetensors metadata carries the schema version, storage dtype, hidden size and the sample ids
(JSON). A shard is written once, atomically (temp file + fsync + rename), and never modified.
The writer streams the safetensors layout itself (header, then each tensor's chunks in order) so a
1 GB shard is never concatenated in memory a second time, and its sha256 is computed while writing.

schema.py   versions, storage dtypes, tensor order and bytes per token, without torch (the planner's)
format.py   `HiddenSample` (one sample's states), `ShardInfo` (a closed shard), the ids' dtype
writer.py   `ShardWriter`: samples in order -> sealed shards of about `shard_bytes`
files.py    one shard's bytes to disk: temp file, sha256 on its own thread, fsync, rename
reader.py   `ShardReader`: per sample or by token range, fp8 dequantized on read or not
keys.py     the store keys of the shards an extract manifest lists, and those the store lacks
"""
# Kept import-free: the planner reads `aerie.shards.schema` and must not pull torch.
