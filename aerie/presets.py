"""Presets are functions that derive a config from a base and change only what differs.

base() ── smollm2_local()   embedded default: SmolLM2-135M on CPU, the whole pipeline in minutes
      ├── smollm2_gpu()     the same target on one H200, every ShareGPT conversation
      └── kimi_k25_8gpu()   Kimi-K2.5 through OpenRouter, SGLang in Docker on 8 GPUs, S3
"""

from __future__ import annotations

from collections.abc import Callable

from aerie.config import PipelineConfig, apply_overrides, load_yaml
from aerie.datasets import SourceSpec
from aerie.errors import ConfigError
from aerie.generate.config import DatasetSpec, EndpointConfig, SamplingParams


def base() -> PipelineConfig:
    """Defaults shared by every preset: the production recipe's training settings."""
    return PipelineConfig(preset="base")


def smollm2_local() -> PipelineConfig:
    """Embedded default: runs on a 2-core laptop with no GPU and no network."""
    cfg = base()
    cfg.preset = "smollm2-local"
    cfg.run = "smollm2-local"
    # Few requests in flight: the reference server pads a batch's prompts on CPU, and ShareGPT has
    # multi-thousand-token first turns from record 25 on (the first 24 are all under ~400 tokens).
    cfg.generate.endpoint = EndpointConfig(base_url=None, concurrency=8)
    cfg.generate.datasets = [
        DatasetSpec(
            name="sharegpt",
            source=SourceSpec(kind="sharegpt"),
            num_samples=24,
            max_turns=1,
            sampling=SamplingParams(temperature=0.0, max_tokens=64),
        )
    ]
    cfg.corpus.max_length = 256
    cfg.corpus.eval_fraction = 0.125
    cfg.corpus.num_workers = 1
    cfg.server.device = "cpu"
    # A laptop's CPU may be busy: give the reference server's load and warm-up generation time.
    cfg.server.startup_timeout_s = 600
    cfg.extract.batch_tokens = 4096
    cfg.extract.shard_bytes = 64 << 20
    # A drafter that learns something in a couple of CPU minutes: small draft vocab, short unroll.
    cfg.train.draft_vocab_size = 2048
    cfg.train.ttt_length = 3
    cfg.train.epochs = 12
    cfg.train.lr = 2e-3
    cfg.train.batch_tokens = 2048
    cfg.train.max_length = 256
    cfg.train.eval_every = 10
    cfg.train.checkpoint_every = 20
    cfg.train.device = "cpu"
    cfg.evaluate.device = "cpu"
    cfg.evaluate.num_steps = [3, 7]
    cfg.evaluate.max_new_tokens = 32
    cfg.evaluate.mtbench_questions = 8
    cfg.evaluate.heldout_samples = 4
    cfg.deploy.concurrency = [1, 4]
    cfg.deploy.num_prompts = 8
    cfg.deploy.max_new_tokens = 32
    return cfg


def smollm2_gpu() -> PipelineConfig:
    """SmolLM2-135M as target on one H200: every complete ShareGPT conversation, regenerated."""
    cfg = base()
    cfg.preset = "smollm2-gpu"
    cfg.run = "smollm2-gpu"
    # CUDA graphs for generation only: 23.0K vs 7.9K generated tokens/s at 256 running
    # (benchmarks/results/decode-h200.json); the deploy stage compares eager servers (see launch_args).
    cfg.generate.endpoint = EndpointConfig(
        base_url=None, concurrency=256, read_timeout_s=600, launch_args=["--cuda-graphs"]
    )
    cfg.generate.datasets = [
        DatasetSpec(
            name="sharegpt",
            source=SourceSpec(kind="sharegpt"),
            # The first three user turns of every conversation: 2.4x the tokens of the first turn alone
            # (15.1M vs 6.2M), MT-Bench 2.54 vs 2.12 at 7 steps, and the pipeline still ~20 GPU minutes
            # (generation 450 s with CUDA graphs; benchmarks/results/h200-pipeline.json). All turns would
            # push generation and training past the 30-minute budget.
            max_turns=3,
            sampling=SamplingParams(temperature=0.0, max_tokens=384),
        )
    ]
    cfg.corpus.max_length = 2048  # three turns: 1024 would cut most conversations short
    cfg.corpus.eval_fraction = 0.01
    cfg.corpus.num_workers = 8
    cfg.server.device = "cuda"
    cfg.server.extra_args = ["--max-running-requests", "256"]
    cfg.extract.storage_dtype = "fp8"
    cfg.extract.batch_tokens = 65536
    cfg.extract.requests_in_flight = 4
    # The server quantizes each pack on the GPU (the same codes as the CPU's, tests/test_extraction_cuda.py,
    # passed on an H200 in session 8): the extract stage ran at 252.9K tokens/s steady against 167.8K with
    # the client quantizing (session 7; benchmarks/results/h200/logs-session8).
    cfg.extract.quantize_on_server = True
    # 15M tokens of fp8 shards are 35 GB: a local copy beside the (local) store's would not fit the
    # H200 host's 64 GB disk, and the preflight refuses it (the store takes each shard over by rename).
    cfg.extract.delete_local_after_upload = True
    cfg.train.device = "cuda"
    # 32K: holds 99.3% of the target's MT-Bench output tokens against 96.7% for 16K; session 6's replay of
    # session 5's answers bounded what 16K lost at 0.19 (benchmarks/results/diagnose-cpu.json).
    cfg.train.draft_vocab_size = 32768
    # Measured on one H200 (benchmarks/results/h200-pipeline.json): lr 1e-3 with the lm_head started from
    # the target's rows beat 5e-4 from scratch (MT-Bench 1.34 vs 1.15 on the small corpus); with 4 epochs
    # the draft MLP at 8x the hidden size beat the target's 1536 (MT-Bench 2.12 vs 2.02 at 7 steps, same
    # first-turn data), and that drafter beat session 3's 2-epoch one on the same 8 prompts at 128 tokens: 1.61 vs 1.43.
    # 3 epochs of the three-turn corpus (44.8M tokens, 266 s) left the held-out acceptance still rising at
    # the schedule's end (3.43 -> 3.51 over its last 300 steps) and MT-Bench at 2.54 (7 steps). 6 epochs
    # with the 32K vocabulary (89.7M tokens, ~670 s): MT-Bench 3.10, held-out 4.11 (session 7,
    # benchmarks/results/h200-pipeline.json), the pipeline still ~27.5 GPU minutes.
    cfg.train.epochs = 6
    cfg.train.draft_intermediate_size = 4608
    cfg.train.lr = 1e-3
    cfg.train.init_head_from_target = True
    cfg.train.batch_tokens = 32768
    cfg.train.max_length = 2048
    cfg.train.eval_every = 100
    cfg.train.checkpoint_every = 200
    cfg.evaluate.device = "cuda"
    # float32: bf16 verify forwards flip near-ties, so only fp32 outputs check losslessness (270/270 vs 97/270).
    cfg.evaluate.dtype = "float32"
    # 384 = the generation cap: the answers the drafter was trained on (128 left out their easier tails).
    cfg.evaluate.max_new_tokens = 384
    cfg.evaluate.batch_size = 32
    cfg.evaluate.heldout_samples = 40
    cfg.deploy.concurrency = [1, 8, 32]
    cfg.deploy.num_prompts = 32
    cfg.deploy.max_new_tokens = 128
    return cfg


def kimi_k25_8gpu() -> PipelineConfig:
    """Kimi-K2.5 (61 layers, hidden 7168, vocab 163840): OpenRouter generation, SGLang in Docker, S3."""
    cfg = base()
    cfg.preset = "kimi-k2.5-8gpu"
    cfg.run = "kimi-k2.5"
    cfg.store.uri = "s3://aerie-artifacts/kimi-k2.5"
    cfg.target.name = "moonshotai/Kimi-K2.5"
    cfg.target.trust_remote_code = True
    cfg.generate.endpoint = EndpointConfig(
        base_url="https://openrouter.ai/api/v1",
        model="moonshotai/kimi-k2.5",
        concurrency=128,
        requests_per_minute=1200,
        title="aerie",
    )
    cfg.generate.datasets = [
        DatasetSpec(
            name="sharegpt",
            source=SourceSpec(kind="sharegpt"),
            sampling=SamplingParams(temperature=0.6, max_tokens=4096),
        ),
    ]
    cfg.generate.max_parallel_datasets = 4
    cfg.corpus.max_length = 4096
    cfg.corpus.num_workers = 16
    cfg.server.backend = "sglang"
    cfg.server.launcher = "docker"
    cfg.server.tp_size = 8
    cfg.server.device = "cuda"
    cfg.server.image = "aerie/sglang-extract:0.5.23"
    cfg.extract.storage_dtype = "fp8"
    cfg.extract.batch_tokens = 65536
    cfg.extract.requests_in_flight = 4
    # 15M tokens of fp8 shards are 35 GB: a local copy beside the (local) store's would not fit the
    # H200 host's 64 GB disk, and the preflight refuses it (the store takes each shard over by rename).
    cfg.extract.delete_local_after_upload = True
    cfg.extract.delete_local_after_upload = True
    cfg.train.device = "cuda"
    cfg.train.num_gpus = 8
    cfg.train.epochs = 10
    cfg.train.lr = 5e-5
    cfg.train.batch_tokens = 16384
    cfg.train.max_length = 4096
    cfg.evaluate.device = "cuda"
    cfg.deploy.num_steps = 3
    cfg.deploy.num_draft_tokens = 4
    return cfg


PRESETS: dict[str, Callable[[], PipelineConfig]] = {
    "smollm2-local": smollm2_local,
    "smollm2-gpu": smollm2_gpu,
    "kimi-k2.5-8gpu": kimi_k25_8gpu,
}


def load_config(preset_or_file: str, overrides: list[str]) -> PipelineConfig:
    """A preset name or YAML file with `key=value` overrides applied (what `aerie run` runs)."""
    cfg = (
        load_yaml(preset_or_file)
        if preset_or_file.endswith((".yaml", ".yml"))
        else get_preset(preset_or_file)
    )
    return apply_overrides(cfg, overrides) if overrides else cfg


def get_preset(name: str) -> PipelineConfig:
    try:
        factory = PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}") from None
    return factory()
