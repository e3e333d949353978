"""Configuration of the drafter training stage."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from aerie.configbase import StrictModel
from aerie.families import DrafterSection, default_settings, family_of
from aerie.targets import DrafterShape, RopeGeometry, TargetGeometry


class DraftShapeConfig(StrictModel):
    """The draft decoder layer's shape. Each field left None takes the target's default
    (`aerie.targets.TargetGeometry.default_drafter`: the target's attention for a dense or GQA target,
    the public Kimi drafters' shape for an MLA one); the hidden size and vocab are always the target's."""

    num_heads: int | None = Field(None, ge=1, description="Query heads; None = the target's.")
    num_kv_heads: int | None = Field(
        None, ge=1, description="K/V heads (divides num_heads); None = the target's (MLA: one per head)."
    )
    head_dim: int | None = Field(
        None, ge=2, description="Width of one head; None = the target's (MLA: its v_head_dim)."
    )
    intermediate_size: int | None = Field(
        None, ge=1, description="MLP width; None = the target's dense MLP's (MoE: its dense layers')."
    )
    rope_theta: float | None = Field(None, gt=0, description="RoPE base; None = the target's.")
    rope_scaling: dict[str, Any] | Literal["none"] | None = Field(
        None,
        description="RoPE scaling with its rope_type (yarn, llama3, linear, ...); none = unscaled; "
        "None = the target's.",
    )

    def resolve(self, geometry: TargetGeometry) -> DrafterShape:
        """The shape for this target: the fields set here over the target's defaults."""
        base = geometry.default_drafter()
        scaling = base.rope.scaling if self.rope_scaling is None else self.rope_scaling
        shape = DrafterShape(
            num_heads=self.num_heads or base.num_heads,
            num_kv_heads=self.num_kv_heads or base.num_kv_heads,
            head_dim=self.head_dim or base.head_dim,
            intermediate_size=self.intermediate_size or base.intermediate_size,
            rope=RopeGeometry(
                theta=self.rope_theta or base.rope.theta, scaling=None if scaling == "none" else scaling
            ),
        )
        if shape.num_heads % shape.num_kv_heads:
            raise ValueError(
                f"train.draft: num_heads {shape.num_heads} is not a multiple of num_kv_heads "
                f"{shape.num_kv_heads} (for target {geometry.architecture})"
            )
        if shape.head_dim % 2:
            raise ValueError(f"train.draft.head_dim {shape.head_dim} must be even (RoPE rotates pairs)")
        return shape

    @model_validator(mode="after")
    def _heads_divide(self) -> DraftShapeConfig:
        if self.num_heads and self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"train.draft.num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if isinstance(self.rope_scaling, dict) and not (
            self.rope_scaling.get("rope_type") or self.rope_scaling.get("type")
        ):
            raise ValueError("train.draft.rope_scaling needs its rope_type (yarn, llama3, linear, ...)")
        return self


class OnlineConfig(StrictModel):
    """Training fed by extraction servers (`train.source: online`): how much it holds, in memory and on disk."""

    buffer_tokens: int = Field(
        65536,
        ge=16,
        description="Tokens of extracted samples held at once: requested ahead of the trainer (prefetched "
        "while it steps) and not yet consumed. Memory stays flat at this however large the corpus (it may go "
        "over by the samples of the one packed row that crossed it).",
    )
    cache_bytes: int = Field(
        0,
        ge=0,
        description="A local on-disk cache of extracted samples (in storage form), filled until it holds this "
        "many bytes and read instead of extracting again in later epochs; 0 = none. Deleted with the work dir.",
    )


class TrainConfig(StrictModel):
    """Train a drafter (EAGLE-3, or the DFlash block drafter) on extracted hidden states."""

    source: Literal["shards", "online", "auto"] = Field(
        "shards",
        description="Where the hidden states come from: shards (the extract stage's, read from the store), "
        "online (the train stage runs extraction servers and trains on what they dump: no shards written), "
        "auto (what `aerie plan` recommends for this config: online when a disk cannot hold the shards).",
    )
    online: OnlineConfig = Field(default_factory=OnlineConfig, description="Settings of train.source online.")

    drafter: DrafterSection = Field(
        default_factory=default_settings,
        description="The drafter family and its own settings (aerie.families), tagged by `family`: eagle3 "
        "chains, dflash blocks (block_size, num_layers, num_target_layers, ...). A family's name alone "
        "(train.drafter=dflash) takes its defaults.",
    )

    draft_vocab_size: int = Field(32000, ge=16, description="Draft vocabulary size (capped at the target's).")
    draft: DraftShapeConfig = Field(
        default_factory=DraftShapeConfig, description="The draft layer's shape (defaults: the target's)."
    )
    ttt_length: int = Field(7, ge=1, description="Training-time-test unroll steps.")
    step_decay: float = Field(0.8, gt=0.0, le=1.0, description="Loss weight of step k is step_decay**k.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training samples used.")
    train_fraction: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Share of the training samples used, the first in corpus order (the merge shuffled "
        "it, so a random subset): a data-size sweep on one extraction. Held-out samples are unaffected.",
    )
    lr: float = Field(1e-4, gt=0, description="Peak learning rate (AdamW).")
    warmup_ratio: float = Field(0.015, ge=0, lt=1, description="Share of steps spent warming up.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="The cosine schedule ends at lr x this.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas.")
    grad_clip: float = Field(0.5, gt=0, description="Gradient norm clip.")
    batch_tokens: int = Field(
        8192, ge=16, description="Packed tokens of one row (a forward and backward) per device."
    )
    batch_sequences: int | None = Field(
        None,
        ge=1,
        description="Samples per optimizer step over all devices, the global batch of trainers that step "
        "one sample at a time: each step accumulates the gradients of round(batch_sequences x mean sample "
        "tokens / (batch_tokens x devices)) rows (at least one), so a step holds that many samples on "
        "average; None = one row of batch_tokens per device a step.",
    )
    loss_normalization: Literal["token", "sequence"] = Field(
        "token",
        description="How a row's loss averages its supervised positions (per TTT step or block slot): "
        "token = every supervised token weighs the same, so long answers weigh more; sequence = each "
        "document's mean, then the mean over the row's documents, so every sample weighs the same (what "
        "trainers that step one sample per device do).",
    )
    max_length: int = Field(2048, ge=16, description="Longest sample (tokens); longer are truncated.")
    split_samples: bool = Field(
        True,
        description="Pack rows full: a sample that does not fit a row's remaining room is cut there and its "
        "rest starts the next row, without the context before the cut. false: it starts the next row whole "
        "(the room left is padding), so every sample up to batch_tokens trains with all of its context.",
    )
    init_head_from_target: bool = Field(
        True,
        description="Start lm_head from the target's lm_head rows of the draft vocab (and norm from its final norm).",
    )
    eval_every: int = Field(200, ge=1, description="Steps between held-out evaluations.")
    eval_max_batches: int | None = Field(
        None, ge=1, description="Cap on eval batches per evaluation; None = the whole eval split."
    )
    heldout_samples: int = Field(
        64, ge=1, description="Samples held out from train when the extract stage has no eval split."
    )
    checkpoint_every: int = Field(500, ge=1, description="Steps between checkpoints.")
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept in the store (plus best).")
    log_every: int = Field(10, ge=1, description="Steps between progress reports.")
    seed: int = Field(0, ge=0, description="Seed for init and data order.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where to train.")
    num_gpus: int = Field(
        1, ge=1, description="Processes for DDP (GPUs; gloo on CPU); > 1 launches torchrun."
    )
    attention: Literal["auto", "flex", "dense"] = Field(
        "auto", description="TTT attention: flex (compiled, CUDA), dense (matmul, CPU); auto picks by device."
    )
    recompute: bool = Field(
        False,
        description="Activation checkpointing over the training-time-test unroll: each step's activations are "
        "recomputed in the backward instead of kept (about a third more compute, most of the unroll's memory "
        "saved); for long max_length (benchmarks/stages/long_context.py measures both).",
    )
    prefetch_batches: int = Field(4, ge=1, description="Batches the background loader keeps ready.")
    cache_dir: str | None = Field(
        None, description="Local dir for downloaded shards and the work dir; None = <AERIE_CACHE_DIR>/train."
    )
    report_to: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list,
        description="Experiment trackers the train, evaluate and deploy stages report to (aerie.trackers; "
        "the `trackers` extra): loss, learning rate, tokens/s, acceptance per position, config and provenance.",
    )
    tracking_dir: str | None = Field(
        None,
        description="Where the trackers write (TensorBoard logs, MLflow's sqlite store, W&B offline runs); "
        "None = <store>/<run>/trackers for a local store, <AERIE_CACHE_DIR>/trackers/<run> for S3.",
    )

    def capture_layers(self, num_layers: int) -> list[int]:
        """The target layers this drafter family reads, output-of-layer ids (what extraction captures)."""
        return family_of(self.drafter).layers(self.drafter, num_layers)

    @model_validator(mode="after")
    def _a_batch_holds_an_unroll(self) -> TrainConfig:
        if self.batch_tokens < self.ttt_length + 2:
            raise ValueError(
                f"train.batch_tokens {self.batch_tokens} must be at least train.ttt_length + 2 = "
                f"{self.ttt_length + 2}: a packed batch must hold one sample of the unroll"
            )
        if not self.split_samples and self.batch_tokens < self.max_length:
            raise ValueError(
                f"train.split_samples=false keeps samples whole, but train.batch_tokens {self.batch_tokens} "
                f"is below train.max_length {self.max_length}: a row cannot hold the longest sample"
            )
        return self
