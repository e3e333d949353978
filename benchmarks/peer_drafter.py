"""aerie's drafter beside SpecForge 0.2.0's, trained on the same extracted features: the adapter that
feeds aerie's hidden-state shards to SpecForge's training step (`OnlineEagle3Model` +
`LlamaForCausalLMEagle3`, compact teacher, batch size 1, its own data layout and recommended learning
rate 1e-4 with cosine decay after 1.5% warm-up, clip 0.5), and the export of SpecForge's drafter into the
directory aerie's evaluator and SGLang read (`aerie.draft.export`: config.json + model.safetensors).

    python benchmarks/peer_drafter.py --shards DIR --target-dir DIR --specforge-path /tmp/sf \\
        --epochs 1 --out DIR

SpecForge is loaded from an unpacked `specforge==0.2.0` wheel at `--specforge-path` (its step needs
triton + CUDA); nothing of it lives in this repository. The data side (`specforge_rows`) and the export
side (`export_specforge`) run on the CPU and are tested in tests/test_peer_drafter.py.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from aerie.draft.export import CONFIG, EXPORT_KEYS, PROVENANCE, WEIGHTS, hf_config
from aerie.draft.model import DraftConfig
from aerie.errors import DataError, TargetError
from aerie.shards.reader import ShardReader
from aerie.targets import TargetInfo

RESULTS = Path(__file__).parent / "results"
# SpecForge's TrainingConfig defaults (config/schema.py): its recommended recipe.
SPECFORGE_LR = 1e-4
SPECFORGE_WARMUP_RATIO = 0.015
SPECFORGE_MAX_GRAD_NORM = 0.5


def shard_paths(root: Path) -> list[Path]:
    """The shards of an extraction, in name order (the order the writer sealed them)."""
    paths = sorted(root.rglob("*.safetensors"))
    if not paths:
        raise DataError(f"no hidden-state shards under {root}")
    return paths


def specforge_rows(
    paths: list[Path], max_len: int, dtype: torch.dtype = torch.bfloat16
) -> Iterator[dict[str, torch.Tensor]]:
    """One SpecForge batch (batch size 1) per sample, in SpecForge's layout: input ids and the
    teacher's last hidden state shifted left by one (position t holds token t+1, the one the drafter
    predicts), the aux states as they are, loss mask [1, T, 1]. Samples longer than `max_len` are cut,
    as SpecForge's own `max_length` does."""
    for path in paths:
        reader = ShardReader(path, dtype=dtype)
        for sample in reader:
            n = min(sample.tokens, max_len)
            ids = sample.input_ids[:n].long()
            last = sample.last_hidden[:n]
            yield {
                "input_ids": torch.cat([ids[1:], ids.new_zeros(1)])[None],
                "attention_mask": torch.ones(1, n, dtype=torch.bool),
                "loss_mask": sample.loss_mask[:n].to(dtype)[None, :, None],
                "hidden_states": sample.aux_hidden[:n][None],
                "target_hidden": torch.cat([last[1:], last[:1] * 0])[None],
            }


def export_specforge(
    state: dict[str, torch.Tensor],
    cfg: DraftConfig,
    target: TargetInfo,
    out_dir: Path,
    provenance: dict[str, Any],
) -> Path:
    """SpecForge's `LlamaForCausalLMEagle3` state dict as aerie's drafter directory: the same key names
    (SGLang's), the embedding dropped (the target's is attached on load), bf16 weights, d2t int64,
    t2d bool. Refuses a state that lacks a key or has an unexpected shape or extra trained weights
    (a `fc_norm` SGLang would not load)."""
    extra = [k for k in state if k not in EXPORT_KEYS and k != "embed_tokens.weight"]
    missing = [k for k in EXPORT_KEYS if k not in state]
    if extra or missing:
        raise TargetError(f"SpecForge drafter state: missing {missing}, not exportable {extra}")
    tensors: dict[str, torch.Tensor] = {}
    for key, shape in EXPORT_KEYS.items():
        tensor = state[key].detach().cpu()
        if tuple(tensor.shape) != shape(cfg):
            raise TargetError(
                f"SpecForge drafter state: {key} is {tuple(tensor.shape)}, expected {shape(cfg)}"
            )
        kind = {"d2t": torch.int64, "t2d": torch.bool}.get(key, torch.bfloat16)
        tensors[key] = tensor.to(kind).contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    (out_dir / CONFIG).write_text(json.dumps(hf_config(cfg, target), indent=2) + "\n")
    meta = {
        "target": target.name,
        "target_revision": target.revision,
        "trainer": "specforge-0.2.0",
        **provenance,
    }
    (out_dir / PROVENANCE).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return out_dir


def cosine_lr(step: int, total: int) -> float:
    """SpecForge's schedule: linear warm-up over 1.5% of the steps, then cosine to zero."""
    warmup = max(1, int(total * SPECFORGE_WARMUP_RATIO))
    if step < warmup:
        return SPECFORGE_LR * (step + 1) / warmup
    return SPECFORGE_LR * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def train_specforge(args: argparse.Namespace, cfg: DraftConfig, embed: torch.Tensor, head: torch.Tensor,
                    d2t: torch.Tensor, t2d: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:  # fmt: skip
    """SpecForge's step over every sample for `--epochs`; returns the drafter's state and the figures."""
    sys.path.insert(0, args.specforge_path)
    from specforge.algorithms.eagle3.model import OnlineEagle3Model  # type: ignore[import-not-found]
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3  # type: ignore[import-not-found]
    from transformers import LlamaConfig

    hf = LlamaConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, draft_vocab_size=cfg.draft_vocab_size,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps, num_hidden_layers=1, pad_token_id=0, hidden_act="silu",
    )  # fmt: skip
    torch.manual_seed(0)
    draft = LlamaForCausalLMEagle3(hf, attention_backend="flex_attention").cuda()
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embed)
        draft.t2d.copy_(t2d)
        draft.d2t.copy_(d2t)
    draft.embed_tokens.weight.requires_grad_(False)
    model = OnlineEagle3Model(draft, length=args.ttt, attention_backend="flex_attention")
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=SPECFORGE_LR, fused=True)
    head = head.cuda().to(torch.bfloat16)
    paths = shard_paths(Path(args.shards))
    samples = sum(len(ShardReader(p)) for p in paths)
    total = samples * args.epochs
    step, tokens, losses = 0, 0, []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.epochs):
        for row in specforge_rows(paths, args.max_len):
            row = {k: v.cuda(non_blocking=True) for k, v in row.items()}
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(step, total)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                plosses, *_ = model(
                    input_ids=row["input_ids"], attention_mask=row["attention_mask"], target=None,
                    loss_mask=row["loss_mask"], hidden_states=row["hidden_states"],
                    target_hidden_for_compact=row["target_hidden"], target_head_weight=head,
                )  # fmt: skip
                loss = sum(0.8**k * p for k, p in enumerate(plosses))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, SPECFORGE_MAX_GRAD_NORM)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step, tokens = step + 1, tokens + int(row["input_ids"].shape[1])
            if step % 500 == 0:
                losses.append(round(float(loss.detach()), 4))
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    figures = {"wall_s": round(wall, 1), "steps": step, "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
               "loss_every_500": losses, "lr": SPECFORGE_LR, "batch_size": 1}  # fmt: skip
    return draft.state_dict(), figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", required=True, help="dir holding the extraction's shards")
    parser.add_argument("--drafter", required=True, help="aerie's exported drafter dir (vocab and geometry)")
    parser.add_argument("--target-json", required=True, help="TargetInfo JSON (the train manifest's target)")
    parser.add_argument(
        "--target-head", required=True, help="safetensors with the target's embed and lm_head"
    )
    parser.add_argument("--specforge-path", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--out", required=True, help="dir: the SpecForge drafter and the figures")
    args = parser.parse_args()
    from safetensors import safe_open

    from aerie.draft.export import config_from_hf

    target = TargetInfo.model_validate_json(Path(args.target_json).read_text())
    cfg = config_from_hf(json.loads((Path(args.drafter) / CONFIG).read_text()))
    with safe_open(str(Path(args.drafter) / WEIGHTS), "pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    with safe_open(args.target_head, "pt") as f:
        embed, head = f.get_tensor("embed"), f.get_tensor("lm_head")
    state, figures = train_specforge(args, cfg, embed.cuda(), head, d2t.cuda(), t2d.cuda())
    out = Path(args.out)
    export_specforge(state, cfg, target, out / "specforge-drafter", {"figures": figures})
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} torch {torch.__version__}, {torch.cuda.get_device_name()}",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "figures": {"specforge": figures},
    }
    (out / "specforge-train.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
