"""Configuration of the drafter training stage."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from aerie.configbase import StrictModel


class TrainConfig(StrictModel):
    """Train an EAGLE-3 drafter on extracted hidden states."""

    draft_vocab_size: int = Field(32000, ge=16, description="Draft vocabulary size (capped at the target's).")
    ttt_length: int = Field(7, ge=1, description="Training-time-test unroll steps.")
    step_decay: float = Field(0.8, gt=0.0, le=1.0, description="Loss weight of step k is step_decay**k.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training shards.")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate (AdamW).")
    warmup_ratio: float = Field(0.015, ge=0, lt=1, description="Share of steps spent warming up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(0.5, gt=0, description="Gradient norm clip.")
    batch_tokens: int = Field(8192, ge=16, description="Packed tokens per optimizer step per device.")
    max_length: int = Field(2048, ge=16, description="Longest sample (tokens); longer are truncated.")
    eval_every: int = Field(200, ge=1, description="Steps between held-out evaluations.")
    checkpoint_every: int = Field(500, ge=1, description="Steps between checkpoints.")
    seed: int = Field(0, description="Seed for init and data order.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where to train.")
    num_gpus: int = Field(1, ge=1, description="GPUs (torchrun DDP when > 1).")
