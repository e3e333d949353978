"""aerie's drafter beside SpecForge 0.2.0's, trained on the same extracted features: the adapter that
feeds aerie's hidden-state shards to SpecForge's training step (`OnlineEagle3Model` +
`LlamaForCausalLMEagle3`, compact teacher, batch size 1, its own data layout, a shuffle per epoch and its
recommended learning rate 1e-4 with cosine decay after 1.5% warm-up, clip 0.5), and the export of
SpecForge's drafter into the directory aerie's evaluator and SGLang read (`aerie.draft.export`).

    python benchmarks/quality/peer_drafter.py --store HOME/store --run smollm2-gpu --specforge-path /tmp/sf --out DIR

Everything is read from a pipeline's store after its train stage: the train split's shards (the ones
aerie's trainer read), the epochs and length cut of aerie's run, and the draft vocabulary (d2t / t2d) and
geometry of aerie's exported drafter, so the two drafters differ only in their trainer. The samples are
put on the device before the clock starts (SpecForge's data loader is not what is timed).

SpecForge is loaded from an unpacked `specforge==0.2.0` wheel at `--specforge-path`; nothing of it lives
in this repository. The data side (`specforge_rows`, `locate`) and the export side (`export_specforge`)
are tested on the CPU in tests/test_peer_drafter.py.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from aerie.draft.export import CONFIG, EXPORT_KEYS, PROVENANCE, WEIGHTS, config_from_hf, hf_config
from aerie.draft.model import DraftConfig
from aerie.errors import DataError, TargetError
from aerie.fp8 import dequantize_fp8
from aerie.shards.keys import shard_keys
from aerie.shards.reader import ShardReader
from aerie.targets import TargetConfig, TargetInfo, resolve_target

# SpecForge's TrainingConfig defaults (config/schema.py): its recommended recipe.
SPECFORGE_LR = 1e-4
SPECFORGE_WARMUP_RATIO = 0.015
SPECFORGE_MAX_GRAD_NORM = 0.5
SPECFORGE_PLOSS_DECAY = 0.8
FIGURES = "specforge-train.json"
DRAFTER = "specforge-drafter"


def shard_paths(root: Path) -> list[Path]:
    """The shards of an extraction, in name order (the order the writer sealed them)."""
    paths = sorted(root.rglob("*.safetensors"))
    if not paths:
        raise DataError(f"no hidden-state shards under {root}")
    return paths


@dataclass
class RunInputs:
    """What a pipeline run's store gives SpecForge's trainer: the same data and vocabulary as aerie's."""

    target: TargetInfo
    drafter_dir: Path  # aerie's exported drafter: geometry, d2t / t2d
    train_shards: list[Path]
    epochs: float
    max_len: int
    train_manifest: dict[str, Any]


def _only_manifest(root: Path, run: str, stage: str) -> tuple[str, dict[str, Any]]:
    """The one finished `stage` of `run` in a local store: its prefix and manifest."""
    found = sorted((root / run / stage).glob("*/manifest.json"))
    if len(found) != 1:
        raise DataError(
            f"{root / run / stage}: expected one finished {stage} stage, found {len(found)} manifests"
        )
    return f"{run}/{stage}/{found[0].parent.name}", json.loads(found[0].read_text())


def locate(store_root: Path, run: str) -> RunInputs:
    """The train split's shards, aerie's drafter and training settings, and the target of `run`."""
    train_prefix, train = _only_manifest(store_root, run, "train")
    extract_prefix, extract = _only_manifest(store_root, run, "extract")
    train_keys, _ = shard_keys(extract, extract_prefix)
    paths = [store_root / key for key in train_keys]
    absent = [str(p) for p in paths if not p.is_file()]
    if absent:
        raise DataError(
            f"{len(absent)} train shard(s) of {extract_prefix} are not in the store: {absent[:3]}"
        )
    named = train["target"]
    target = resolve_target(TargetConfig(name=named["name"]))
    if target.revision != named["revision"]:
        raise TargetError(
            f"the store's drafter was trained for {named['name']} revision {named['revision']}, "
            f"this host resolves revision {target.revision}"
        )
    config = train["training"]["config"]
    return RunInputs(
        target=target,
        drafter_dir=store_root / train_prefix / "drafter",
        train_shards=paths,
        epochs=float(config["epochs"]),
        max_len=int(config["max_length"]),
        train_manifest=train,
    )


def _read(reader: ShardReader, i: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Sample `i` with its hidden states moved to `device` first and dequantized there (fp8 codes are
    half the bytes of bf16 and the device dequantizes them far faster than the CPU)."""
    start, end = int(reader.offsets[i]), int(reader.offsets[i + 1])
    part = reader.token_slice(start, end, dequantize=False)
    moved = {k: v.to(device) for k, v in part.items()}
    if "aux_scale" in moved:
        moved["aux_hidden"] = dequantize_fp8(moved.pop("aux_hidden"), moved.pop("aux_scale"), dtype)
        moved["last_hidden"] = dequantize_fp8(moved.pop("last_hidden"), moved.pop("last_scale"), dtype)
    else:
        moved["aux_hidden"], moved["last_hidden"] = (
            moved["aux_hidden"].to(dtype),
            moved["last_hidden"].to(dtype),
        )
    return moved


def specforge_rows(
    paths: list[Path], max_len: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"
) -> Iterator[dict[str, torch.Tensor]]:
    """One SpecForge batch (batch size 1) per sample, in SpecForge's layout: input ids and the
    teacher's last hidden state shifted left by one (position t holds token t+1, the one the drafter
    predicts), the aux states as they are, loss mask [1, T, 1]. Samples longer than `max_len` are cut,
    as SpecForge's own `max_length` does."""
    for path in paths:
        reader = ShardReader(path, dtype=dtype)
        for i in range(len(reader)):
            sample = _read(reader, i, device, dtype)
            n = min(int(sample["input_ids"].shape[0]), max_len)
            ids = sample["input_ids"][:n].long()
            last = sample["last_hidden"][:n]
            yield {
                "input_ids": torch.cat([ids[1:], ids.new_zeros(1)])[None],
                "attention_mask": torch.ones(1, n, dtype=torch.bool, device=ids.device),
                "loss_mask": sample["loss_mask"][:n].to(dtype)[None, :, None],
                "hidden_states": sample["aux_hidden"][:n][None],
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


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """SpecForge's deterministic shuffle of an epoch (`random.Random(seed + epoch)`)."""
    order = list(range(n))
    random.Random(seed + epoch).shuffle(order)
    return order


def _specforge_draft(path: str, cfg: DraftConfig, device: str, attention: str) -> Any:
    """SpecForge's drafter for `cfg`'s geometry, on `device` (float32 weights, as its fp32 masters)."""
    sys.path.insert(0, path)
    if not device.startswith("cuda"):
        _reference_loss()
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3  # type: ignore[import-not-found]
    from transformers import LlamaConfig

    hf = LlamaConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, draft_vocab_size=cfg.draft_vocab_size,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps, num_hidden_layers=1, pad_token_id=0, hidden_act="silu",
    )  # fmt: skip
    return LlamaForCausalLMEagle3(hf, attention_backend=attention).to(device)


def _reference_loss() -> None:
    """Off CUDA only (the CPU dry run): SpecForge's loss is a Triton kernel, which needs a GPU, so its
    module is replaced by one holding SpecForge's own reference formula (`_compute_loss` in
    specforge/core/loss.py: the masked soft cross-entropy averaged over every position)."""
    import types

    class ReferenceLogSoftmaxLoss:
        @staticmethod
        def apply(logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
            logp = torch.log_softmax(logits.float(), dim=2)
            return -torch.sum(position_mask * target_p * logp, 2).mean()

    module = types.ModuleType("specforge.core.loss")
    module.LogSoftmaxLoss = ReferenceLogSoftmaxLoss  # type: ignore[attr-defined]
    sys.modules["specforge.core.loss"] = module


def train_specforge(
    args: argparse.Namespace, inputs: RunInputs, cfg: DraftConfig
) -> tuple[Any, dict[str, Any]]:
    """SpecForge's step over every train sample for the run's epochs, each epoch shuffled; returns the
    drafter and the figures. Stops early (and says so) past `--deadline-s` of training."""
    from aerie.draft.target_weights import load_embedding, load_lm_head

    device = args.device
    setup_started = time.perf_counter()
    torch.manual_seed(args.seed)
    attention = args.attention or ("flex_attention" if device.startswith("cuda") else "sdpa")
    draft = _specforge_draft(args.specforge_path, cfg, device, attention)
    from specforge.algorithms.eagle3.model import OnlineEagle3Model  # type: ignore[import-not-found]

    with safe_open(str(inputs.drafter_dir / WEIGHTS), "pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(load_embedding(inputs.target))
        draft.t2d.copy_(t2d)
        draft.d2t.copy_(d2t)
    draft.embed_tokens.weight.requires_grad_(False)
    model = OnlineEagle3Model(draft, length=args.ttt, attention_backend=attention)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=SPECFORGE_LR, weight_decay=0.0, fused=device.startswith("cuda"))
    head = load_lm_head(inputs.target).to(device, torch.bfloat16)
    rows = list(specforge_rows(inputs.train_shards, inputs.max_len, device=device))
    # Counted here, not in the loop: reading a device tensor there would wait for every step.
    supervised_per_row = [int(r["loss_mask"].sum()) for r in rows]
    epochs = _whole_epochs(args.epochs if args.epochs is not None else inputs.epochs)
    total = len(rows) * epochs
    setup_s = time.perf_counter() - setup_started
    step, tokens, supervised, losses, recent = 0, 0, 0, [], []
    stopped_early = False
    _sync(device)
    start = time.perf_counter()
    for epoch in range(epochs):
        for i in epoch_order(len(rows), args.seed, epoch):
            row = rows[i]
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(step, total)
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
                plosses, *_ = model(
                    input_ids=row["input_ids"], attention_mask=row["attention_mask"], target=None,
                    loss_mask=row["loss_mask"], hidden_states=row["hidden_states"],
                    target_hidden_for_compact=row["target_hidden"], target_head_weight=head,
                )  # fmt: skip
                loss = sum(SPECFORGE_PLOSS_DECAY**k * p for k, p in enumerate(plosses))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, SPECFORGE_MAX_GRAD_NORM)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens += int(row["input_ids"].shape[1])
            supervised += supervised_per_row[i]
            if step % args.log_every == 0:
                recent.append(float(loss.detach()))
                losses.append(round(recent[-1], 4))
                if args.deadline_s and time.perf_counter() - start > args.deadline_s:
                    stopped_early = True
                    break
        if stopped_early:
            break
    _sync(device)
    wall = time.perf_counter() - start
    figures = {
        "wall_s": round(wall, 1),
        "setup_s": round(setup_s, 1),
        "steps": step,
        "total_steps": total,
        "epochs": epochs,
        "samples": len(rows),
        "tokens": tokens,
        "supervised_tokens": supervised,
        "tokens_per_s": round(tokens / wall, 1),
        "seconds_per_step": round(wall / max(1, step), 4),
        f"loss_every_{args.log_every}": losses,
        "lr": SPECFORGE_LR,
        "warmup_ratio": SPECFORGE_WARMUP_RATIO,
        "max_grad_norm": SPECFORGE_MAX_GRAD_NORM,
        "batch_size": 1,
        "ttt_length": args.ttt,
        "attention": attention,
        "loss_kernel": "triton" if device.startswith("cuda") else "reference formula (no GPU)",
        "stopped_early": stopped_early,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if device.startswith("cuda")
        else None,
    }
    return draft, figures


def _whole_epochs(epochs: float) -> int:
    if epochs != int(epochs) or epochs < 1:
        raise DataError(f"SpecForge trains whole epochs; aerie's run trained {epochs}")
    return int(epochs)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _machine(device: str) -> str:
    gpu = f", {torch.cuda.get_device_name()}" if device.startswith("cuda") else ", cpu"
    return f"{platform.node()} {platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}{gpu}"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--store", required=True, help="the pipeline's local store (HOME/store)")
    parser.add_argument("--run", required=True, help="the run's name in the store (the preset's run)")
    parser.add_argument(
        "--specforge-path", required=True, help="dir holding an unpacked specforge==0.2.0 wheel"
    )
    parser.add_argument("--out", required=True, help="dir: the SpecForge drafter and its figures")
    parser.add_argument("--epochs", type=float, help="default: the epochs of aerie's run")
    parser.add_argument(
        "--ttt", type=int, default=7, help="SpecForge's ttt_length (its default, aerie's too)"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--attention",
        help="SpecForge's backend; default flex_attention on CUDA, sdpa elsewhere (flex has no CPU backward)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=500)
    parser.add_argument("--deadline-s", type=float, default=0.0, help="stop training after this (0: never)")
    args = parser.parse_args()
    inputs = locate(Path(args.store), args.run)
    cfg = config_from_hf(json.loads((inputs.drafter_dir / CONFIG).read_text()))
    draft, figures = train_specforge(args, inputs, cfg)
    out = Path(args.out)
    export_specforge(draft.state_dict(), cfg, inputs.target, out / DRAFTER, {"figures": figures})
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(args.device),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "figures": {"specforge": figures},
    }
    (out / FIGURES).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
