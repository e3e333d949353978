"""A run's plan: sizes, cost, per-stage seconds and disk, and the checks that refuse what cannot fit."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from aerie.config import PipelineConfig
from aerie.errors import ContextLengthError, GpuMemoryError, NotEnoughDiskError, PlanError
from aerie.plan import disk, online, sizes, throughput
from aerie.plan.facts import Hardware, TargetFacts, hardware, rates, target_facts
from aerie.plan.lengths import LengthPlan, estimate_lengths
from aerie.plan.machine import MachineSpeed, machine_speed
from aerie.plan.prices import Cost, api_cost

# Share of a GPU's memory a server may give its weights (SGLang's --mem-fraction-static leaves the rest
# for the KV cache and activations).
WEIGHT_MEMORY_FRACTION = 0.85
# Peak memory of a training step taken as proportional to its tokens (the record's step scaled).
MEASURED_STEP_MEMORY = {"smollm2-135m-instruct": "train_smollm2_peak_memory_gib"}


@dataclass
class Plan:
    cfg: PipelineConfig
    target: TargetFacts
    hardware: Hardware
    sizes: sizes.Sizes
    cost: Cost
    stages: list[throughput.StageEstimate]
    disk: disk.DiskPlan
    machine: MachineSpeed | None = None  # a CPU plan: this machine against the calibration's
    lengths: LengthPlan | None = None  # turn lengths and what the limits keep of them
    refusals: list[PlanError] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages)

    @property
    def gpu_seconds(self) -> float:
        return sum(s.gpu_seconds for s in self.stages)

    def stage(self, name: str) -> throughput.StageEstimate | None:
        return next((s for s in self.stages if s.stage == name), None)

    def record(self) -> dict[str, Any]:
        """The plan as JSON-able data (manifests, artifacts, `aerie plan --json`)."""
        return {
            "preset": self.cfg.preset,
            "hardware": self.hardware.name,
            "target": self.target.name,
            "sizes": {
                "conversations": self.sizes.conversations,
                "turns": self.sizes.turns,
                "prompt_tokens": self.sizes.prompt_tokens,
                "completion_tokens": self.sizes.completion_tokens,
                "corpus_tokens": self.sizes.corpus_tokens,
                "supervised_tokens": self.sizes.supervised_tokens,
                "train_tokens": self.sizes.train_tokens,
                "chars_per_token": round(self.sizes.chars_per_token, 3),
            },
            "api_usd": self.cost.total_usd,
            "stages": [
                {
                    "stage": s.stage,
                    "seconds": round(s.seconds, 1),
                    "gpus": s.gpus,
                    "gpu_seconds": round(s.gpu_seconds, 1),
                }
                for s in self.stages
            ],
            "seconds": round(self.seconds, 1),
            "gpu_seconds": round(self.gpu_seconds, 1),
            "disk": [
                {"location": loc.name, "need": loc.need, "free": loc.free} for loc in self.disk.locations
            ],
            "shard_bytes": self.disk.shard_bytes,
            "s3_bytes": self.disk.s3_bytes,
            "s3_requests": self.disk.s3_requests,
            "machine": None
            if self.machine is None
            else {
                "gemm_gflops_now": round(self.machine.gflops_now, 1),
                "gemm_gflops_calibrated": self.machine.gflops_calibrated,
                "ratio": round(self.machine.ratio, 3),
                "others_share": round(self.machine.others_share, 2),
            },
            "refusals": [str(r) for r in self.refusals],
            "lengths": None if self.lengths is None else self.lengths.record(),
        }


def default_hardware(cfg: PipelineConfig) -> str:
    """The hardware a preset runs on: the H200 (the GPU measured) when any stage runs on CUDA."""
    on_cuda = "cuda" in (cfg.server.device, cfg.train.device, cfg.evaluate.device)
    return "h200" if on_cuda else "cpu"


def make_plan(cfg: PipelineConfig, hardware_name: str | None = None, *, fixed: bool = True) -> Plan:
    """Everything `aerie plan` prints; `refusals` holds what cannot fit (raise them with `check`).
    `fixed` False leaves the CPU stages' fixed seconds out (their calibration)."""
    hw = hardware(hardware_name or default_hardware(cfg))
    target = target_facts(cfg.target)
    size = sizes.estimate(cfg, target)
    plan = Plan(
        cfg=cfg,
        target=target,
        hardware=hw,
        sizes=size,
        cost=api_cost(cfg.generate.endpoint, size),
        stages=throughput.estimate(cfg, target, size, hw, fixed),
        disk=disk.estimate(cfg, target, size),
        machine=None if hw.gpu else machine_speed(rates(hw.name) or {}),
        lengths=estimate_lengths(cfg, size.profiles, size.chars_per_token),
    )
    plan.refusals = [*_context(cfg, target), *_gpu_memory(cfg, target, hw), *_disk(plan)]
    return plan


def with_corpus(plan: Plan, figures: dict[str, Any], *, fixed: bool = True) -> Plan:
    """The plan once the corpus exists: its measured records and tokens (the merge stage's figures) in
    place of the estimate from a sample, and the later stages' seconds and disk from them; the stages
    before it keep their estimates. `fixed` as in `make_plan`."""
    cfg, est = plan.cfg, plan.sizes
    measured = replace(
        est,
        corpus_records=int(figures["records"]),
        corpus_tokens=int(figures["tokens"]),
        supervised_tokens=int(figures["supervised_tokens"]),
        train_tokens=round(int(figures["train_tokens"]) * cfg.train.train_fraction * cfg.train.epochs),
        eval_tokens=int(figures["eval_tokens"]),
        # A corpus stored before the merge counted its eval records keeps the estimate.
        eval_records=int(figures.get("eval_records", est.eval_records)),
    )
    later = {s.stage: s for s in throughput.estimate(cfg, plan.target, measured, plan.hardware, fixed)}
    done = ("generate", "merge")
    stages = [s if s.stage in done else later.get(s.stage, s) for s in plan.stages]
    return replace(plan, sizes=measured, stages=stages, disk=disk.estimate(cfg, plan.target, measured))


def check(plan: Plan) -> Plan:
    """Raise the first refusal (its message lists every one of its kind); the plan when none."""
    if plan.refusals:
        raise plan.refusals[0]
    return plan


def _context(cfg: PipelineConfig, target: TargetFacts) -> list[PlanError]:
    limit = target.geometry.max_position_embeddings
    lengths = {
        "corpus.max_length": cfg.corpus.max_length,
        "train.max_length": cfg.train.max_length,
        "evaluate.max_prompt_tokens + evaluate.max_new_tokens": cfg.evaluate.max_prompt_tokens
        + cfg.evaluate.max_new_tokens,
    }
    over = {k: v for k, v in lengths.items() if v > limit}
    if not over:
        return []
    listed = ", ".join(f"{k} = {v:,}" for k, v in over.items())
    return [
        ContextLengthError(
            f"{listed}: beyond {target.name}'s context of {limit:,} tokens; lower it to {limit:,} at most"
        )
    ]


def _gpu_memory(cfg: PipelineConfig, target: TargetFacts, hw: Hardware) -> list[PlanError]:
    if not hw.gpu:
        return []
    problems: list[PlanError] = []
    usable = hw.memory_bytes * WEIGHT_MEMORY_FRACTION
    per_gpu = target.weight_bytes / cfg.server.tp_size
    if cfg.server.device == "cuda" and per_gpu > usable:
        need = int(-(-target.weight_bytes // usable))
        problems.append(
            GpuMemoryError(
                f"{target.name}: {target.weight_bytes / 1e9:,.0f} GB of weights over server.tp_size "
                f"{cfg.server.tp_size} = {per_gpu / 1e9:,.0f} GB per GPU, more than the "
                f"{usable / 1e9:,.0f} GB a {hw.name} gives weights ({WEIGHT_MEMORY_FRACTION:.0%} of "
                f"{hw.memory_bytes / 1e9:,.0f} GB); set server.tp_size={need} or more"
            )
        )
    if cfg.evaluate.enabled and cfg.evaluate.device == "cuda" and target.weight_bytes > usable:
        problems.append(
            GpuMemoryError(
                f"evaluate.device cuda: the offline evaluator loads {target.name} on one GPU, "
                f"{target.weight_bytes / 1e9:,.0f} GB of weights against the {usable / 1e9:,.0f} GB a "
                f"{hw.name} gives weights; evaluate on a served target (the deploy stage) or a smaller one"
            )
        )
    measured = rates("h200") or {}
    key = MEASURED_STEP_MEMORY.get(target.name, "train_kimi_peak_memory_gib")
    if cfg.train.device != "cpu" and key in measured:
        bench_batch = 16384  # both memory records are 16,384-token steps (train-h200.json)
        step = measured[key].value * 2**30 * cfg.train.batch_tokens / bench_batch
        if step > hw.memory_bytes:
            fits = int(bench_batch * hw.memory_bytes / (measured[key].value * 2**30)) // 1024 * 1024
            problems.append(
                GpuMemoryError(
                    f"train.batch_tokens {cfg.train.batch_tokens:,}: a step needs about {step / 2**30:,.0f} GiB "
                    f"({measured[key].value} GiB at {bench_batch:,} tokens, {measured[key].source}, scaled), "
                    f"more than a {hw.name}'s {hw.memory_bytes / 2**30:,.0f} GiB; set train.batch_tokens={fits} or less"
                )
            )
    return problems


def _disk(plan: Plan) -> list[PlanError]:
    short = [loc for loc in plan.disk.locations if loc.short]
    if plan.cfg.train.source == "auto":  # short only with the shards: auto goes online and writes none
        forgiven = online.short_for_shards(plan.disk)
        short = [loc for loc in short if loc.name not in forgiven]
    if not short:
        return []
    lines = [
        f"{loc.name}: needs {_gb(loc.need)} ({', '.join(f'{k} {_gb(v)}' for k, v in loc.parts.items() if v)}), "
        f"{_gb(loc.free or 0)} free (short by {_gb(loc.need - (loc.free or 0))})"
        for loc in short
    ]
    return [NotEnoughDiskError("not enough disk for this run: " + "; ".join(lines))]


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"
