"""Seconds per stage, from throughput models whose rates are measured (`data/calibration.json`, each
figure naming its benchmark record) on the preset's hardware; hardware without measurements scales the
H200's rates by datasheet FLOP/s (compute-bound stages) or memory bandwidth (decode-bound ones), and a
target larger than the measured one is modelled from its FLOPs per token. Every figure that is not
measured is an assumption, and each estimate lists the ones it used."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from aerie.config import PipelineConfig
from aerie.families import family_of

# The calibration drafter benchmarks/stages/train.py measured is an EAGLE-3 one: its FLOPs are that family's count.
from aerie.families.eagle3 import ttt_flops_per_token
from aerie.plan.facts import Hardware, Rate, TargetFacts, hardware, rates
from aerie.plan.sizes import Sizes

# Assumptions, printed with every estimate that uses them.
API_TOKENS_PER_S = 40.0  # one OpenRouter stream's output speed for a large MoE model
API_FIRST_TOKEN_S = 1.5  # its time to first token
MOE_PREFILL_MFU = 0.30  # share of peak FLOP/s a tensor-parallel MoE prefill reaches
MULTI_GPU_EFFICIENCY = 0.9  # data-parallel training across the GPUs of one host
SERVER_START_S = 60.0  # a large-model server's fixed start-up beyond reading its weights
WEIGHT_READ_BYTES_PER_S = 2e9  # a large checkpoint read from local NVMe (page cache cold)
HOST_CORES = {"cpu": 2}  # the corpus build's cores; GPU hosts: 16
MEASURED_TARGET = "smollm2-135m-instruct"  # the target the H200 and CPU rates were measured with


@dataclass
class StageEstimate:
    stage: str
    seconds: float
    gpus: int
    formula: str
    calibrated_by: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    roofline: str = ""  # its rate against the hardware's peak FLOP/s (and the disk's write rate)

    @property
    def gpu_seconds(self) -> float:
        return self.seconds * self.gpus


def prefill_flops_per_token(target: TargetFacts, seq_len: int) -> float:
    """2 x active parameters, plus attention over ~seq/2 keys in every layer: q.k over the query/key
    width and p.v over the value width of each head (MLA: 192 and 128)."""
    att = target.geometry.attention
    attention = 2 * target.geometry.num_layers * att.num_heads * (att.head_dim + att.v_head_dim) * seq_len / 2
    return 2 * target.active_params + attention


def roofline(
    m: Model,
    rate: float,
    flops_per_token: float,
    devices: int,
    bytes_per_token: float | None = None,
    unit: str = "tokens",
) -> str:
    """A rate as a fraction of what bounds it: the devices' peak FLOP/s for the work of a token (the
    target's active parameters, or the drafter's step), and, for shards, the disk's measured write rate,
    so a reader can judge how much is left."""
    devices = max(1, devices)
    peak = devices * m.hw.peak_flops
    each = (
        f"{m.hw.peak_flops / 1e12:,.1f} TFLOP/s"
        if m.hw.peak_flops >= 1e12
        else f"{m.hw.peak_flops / 1e9:,.0f} GFLOP/s"
    )
    said = (
        f"{rate:,.0f} {unit}/s x {flops_per_token / 1e9:.3g} GFLOP each = {rate * flops_per_token / peak:.1%} of "
        f"{devices} x {each} ({m.hw.name} peak)"
    )
    disk = m.rates.get("disk_write_bytes_per_s")
    if bytes_per_token and disk is not None:
        written = rate * bytes_per_token
        said += (
            f"; shard writes {written / 1e6:,.0f} MB/s = {written / disk.value:.0%} of the disk's measured "
            f"{disk.value / 1e6:,.0f} MB/s"
        )
    return said


class Model:
    """The rates of one hardware, measured or scaled from the H200's, and the notes saying which."""

    def __init__(
        self, cfg: PipelineConfig, target: TargetFacts, hw: Hardware, use_fixed: bool = True
    ) -> None:
        self.cfg, self.target, self.hw = cfg, target, hw
        measured = rates(hw.name)
        self.scaled = measured is None
        self.rates: dict[str, Rate] = measured if measured is not None else rates("h200") or {}
        self.base = hardware("h200")
        self.same_target = target.name == MEASURED_TARGET
        self.use_fixed = use_fixed

    def rate(self, key: str, bound: str, notes: list[str], cites: list[str]) -> float:
        """A measured rate; on unmeasured hardware the H200's, scaled by `bound` ('flops' or 'bandwidth')."""
        r = self.rates[key]
        cites.append(r.cite())
        if not self.scaled:
            return r.value
        attr = "peak_flops" if bound == "flops" else "memory_bandwidth"
        factor = getattr(self.hw, attr) / getattr(self.base, attr)
        notes.append(f"{self.hw.name} has no measurements: the H200's rate scaled by {attr} x{factor:.2f}")
        return r.value * factor

    def fixed(self, stage: str, gpu_seconds: float, notes: list[str], cites: list[str]) -> float:
        """A stage's fixed seconds (start-up, loading): CPU from the calibration run, GPUs from the
        measured server start-up."""
        fixed = self.rates.get(f"fixed_{stage}_s")
        if not self.use_fixed:
            return 0.0
        if self.hw.gpu or fixed is None:
            return gpu_seconds
        cites.append(fixed.cite())
        return fixed.value

    def server_start(self, notes: list[str], cites: list[str]) -> float:
        """Seconds from launch to ready for the target's server."""
        if not self.same_target:
            read = self.target.weight_bytes / WEIGHT_READ_BYTES_PER_S
            notes.append(
                f"server start: {self.target.weight_bytes / 1e9:.0f} GB of weights read at "
                f"{WEIGHT_READ_BYTES_PER_S / 1e9:.0f} GB/s + {SERVER_START_S:.0f} s"
            )
            return read + SERVER_START_S
        return self.measured_start(cites)

    def measured_start(self, cites: list[str]) -> float:
        """The measured target's server start-up on the H200: extraction's wall time less its steady part."""
        wall = self.rates["extract_fp8_server_wall_s"].value
        tokens = self.rates["extract_fp8_server_tokens"].value
        steady = self.rates["extract_fp8_server_tokens_per_s"].value
        cites.append("server start-up: extraction wall time less its steady tokens/s (extract-h200.json)")
        return max(0.0, wall - tokens / steady)


def estimate(
    cfg: PipelineConfig, target: TargetFacts, sizes: Sizes, hw: Hardware, use_fixed: bool = True
) -> list[StageEstimate]:
    """Every stage's estimate; `use_fixed` False leaves out the CPU stages' fixed seconds and speed
    factors (the variable part their calibration fits against measured runs)."""
    model = Model(cfg, target, hw, use_fixed)
    out = _stages(model, sizes)
    if hw.gpu or not use_fixed:
        return out
    variable = _stages(Model(cfg, target, hw, use_fixed=False), sizes)
    return [_at_machine_speed(e, v.seconds, model.rates) for e, v in zip(out, variable, strict=True)]


def _stages(model: Model, sizes: Sizes) -> list[StageEstimate]:
    cfg = model.cfg
    out = [_generate(model, sizes), _merge(model, sizes), _extract(model, sizes), _train(model, sizes)]
    if cfg.evaluate.enabled:
        out.append(_evaluate(model, sizes))
    if cfg.deploy.enabled:
        out.append(_deploy(model, sizes))
    return out


def _at_machine_speed(est: StageEstimate, variable_s: float, measured: dict[str, Rate]) -> StageEstimate:
    """A CPU stage's variable part times its speed factor: how much longer than its benchmark rates say
    the stage's work took on the machine of the calibration runs (two short runs: a factor per stage,
    since a machine slower at matrix products need not be slower at tokenizing). CPU records come from
    machines of differing speeds; the factor ties the estimate to one machine, the calibration's."""
    speed = measured.get(f"speed_{est.stage}")
    if speed is None:
        return est
    fixed = est.seconds - variable_s
    return replace(
        est,
        seconds=fixed + speed.value * variable_s,
        formula=f"{est.formula}; its variable part x {speed.value:.2f} on this machine",
        calibrated_by=[*est.calibrated_by, speed.cite()],
    )


def _generate(m: Model, sizes: Sizes) -> StageEstimate:
    cfg, notes, cites = m.cfg, [], []  # type: ignore[var-annotated]
    endpoint = cfg.generate.endpoint
    waves = math.ceil(len(cfg.generate.datasets) / cfg.generate.max_parallel_datasets)
    if endpoint.base_url is not None:
        turns = max(1, sizes.turns)
        per_turn = sizes.completion_tokens / turns
        latency = API_FIRST_TOKEN_S + per_turn / API_TOKENS_PER_S
        by_concurrency = turns * latency / endpoint.concurrency
        by_limit = turns / (endpoint.requests_per_minute / 60) if endpoint.requests_per_minute else 0.0
        notes.append(
            f"an API stream: {API_FIRST_TOKEN_S} s to the first token, then {API_TOKENS_PER_S:.0f} tokens/s; "
            f"{endpoint.concurrency} in flight"
            + (
                f", at most {endpoint.requests_per_minute:.0f} requests/min"
                if endpoint.requests_per_minute
                else ""
            )
        )
        seconds = max(by_concurrency, by_limit)
        return StageEstimate(
            "generate",
            seconds,
            0,
            f"{turns:,} requests x {latency:.1f} s / {endpoint.concurrency} in flight",
            cites,
            notes,
        )
    if m.hw.gpu:
        graphs = "--cuda-graphs" in endpoint.launch_args
        if graphs:
            decode = _graphs_decode(m, sizes, notes, cites)
        else:
            steps = m.rate("decode_eager_steps_per_s", "bandwidth", notes, cites)
            decode = steps * endpoint.concurrency
            notes.append(f"eager decoding: {endpoint.concurrency} sequences advance per step")
        prefill = m.rate("prefill_tokens_per_s", "flops", notes, cites)
        start = m.server_start(notes, cites)
    else:
        decode = m.rate("decode_tokens_per_s", "bandwidth", notes, cites)
        prefill = m.rate("extract_tokens_per_s", "flops", notes, cites)
        start = m.fixed("generate", 0.0, notes, cites)
    seconds = waves * start + sizes.completion_tokens / decode + sizes.prompt_tokens / prefill
    decode_flops = prefill_flops_per_token(m.target, int(2 * mean_decode_context(sizes)))
    gpus = cfg.server.tp_size if m.hw.gpu else 0
    formula = (
        f"{start:.0f} s start + {sizes.completion_tokens:,} completion tokens / {decode:,.0f}/s "
        f"+ {sizes.prompt_tokens:,} prompt tokens / {prefill:,.0f}/s"
    )
    bound = "decode " + roofline(m, decode, decode_flops, gpus)
    return StageEstimate("generate", seconds, gpus, formula, cites, notes, bound)


def decode_rate_at(points: list[tuple[float, float]], context: float) -> float:
    """Tokens/s at a mean decode context, linear between the measured (context, tokens/s) points and
    clamped to the nearest one outside them: beyond the measured range the shape is unknown."""
    ordered = sorted(points)
    if context <= ordered[0][0]:
        return ordered[0][1]
    for (x0, y0), (x1, y1) in zip(ordered, ordered[1:], strict=False):
        if context <= x1:
            return y0 + (y1 - y0) * (context - x0) / (x1 - x0)
    return ordered[-1][1]


def mean_decode_context(sizes: Sizes) -> float:
    """The mean context a generated token is decoded against, as benchmarks/stages/decode.py defines it (the
    i-th of n new tokens sees prompt + i positions), from the per-request means: prompt + completion / 2."""
    requests = max(1, sizes.turns)
    return (sizes.prompt_tokens + sizes.completion_tokens / 2) / requests


def context_points(m: Model) -> list[tuple[float, float]]:
    """The measured CUDA-graphs (mean context, tokens/s) points of this hardware's calibration."""
    points = []
    for i in range(len(m.rates)):
        ctx, rate = (
            m.rates.get(f"decode_graphs_context_{i}_tokens"),
            m.rates.get(f"decode_graphs_context_{i}_tokens_per_s"),
        )
        if ctx is None or rate is None:
            break
        points.append((ctx.value, rate.value))
    return points


def _graphs_decode(m: Model, sizes: Sizes, notes: list[str], cites: list[str]) -> float:
    """The CUDA-graphs decode rate at the plan's own mean context: each later turn's prompt holds the
    earlier turns, and attention over a longer context slows every step."""
    points = context_points(m)
    if not points:
        return m.rate("decode_graphs_tokens_per_s", "bandwidth", notes, cites)
    context = mean_decode_context(sizes)
    decode = decode_rate_at(points, context)
    source = m.rates["decode_graphs_context_0_tokens_per_s"].source
    shown = ", ".join(f"{x:.1f} -> {y:,.0f}/s" for x, y in points)
    cites.append(f"CUDA-graphs decode tokens/s by mean context ({source}: {shown})")
    notes.append(
        f"decode at a mean context of {context:,.0f} tokens (prompt + completion / 2 per request): "
        f"{decode:,.0f} tokens/s, interpolated between the measured points, clamped outside them"
    )
    if m.scaled:
        factor = m.hw.memory_bandwidth / m.base.memory_bandwidth
        notes.append(
            f"{m.hw.name} has no measurements: the H200's rate scaled by memory_bandwidth x{factor:.2f}"
        )
        decode *= factor
    return decode


def _merge(m: Model, sizes: Sizes) -> StageEstimate:
    notes: list[str] = []
    cites: list[str] = []
    per_mtok = m.rates["merge_cpu_s_per_mtok"]
    cites.append(per_mtok.cite())
    cores = HOST_CORES.get(m.hw.name, 16)
    workers = max(1, min(m.cfg.corpus.num_workers, cores))
    fixed = m.fixed("merge", 0.0, notes, cites)
    if m.hw.gpu:
        notes.append(
            "no fixed part: the host's corpus benchmark's CPU-seconds per token include its start-up"
        )
    busy = sizes.corpus_tokens / 1e6 * per_mtok.value / workers
    parent = m.rates["merge_parent_cpu_s"]
    serial = sizes.corpus_tokens * parent.value / m.rates["merge_bench_tokens"].value
    cites.append(parent.cite())
    formula = (
        f"{fixed:.0f} s + {sizes.corpus_tokens:,} tokens x {per_mtok.value} CPU-s/M / {workers} workers "
        f"+ {serial:.1f} s serial"
    )
    return StageEstimate("merge", fixed + busy + serial, 0, formula, cites, notes)


def _extract(m: Model, sizes: Sizes) -> StageEstimate:
    cfg, notes, cites = m.cfg, [], []  # type: ignore[var-annotated]
    tokens = sizes.corpus_tokens
    servers = cfg.extract.num_servers * (cfg.extract.num_slices if cfg.extract.slice_deployment else 1)
    gpus = servers * cfg.server.tp_size if m.hw.gpu else 0
    if not m.hw.gpu:
        rate = m.rate("extract_tokens_per_s", "flops", notes, cites)
        start = m.fixed("extract", 0.0, notes, cites)
    elif m.same_target:
        fp8_server = cfg.extract.storage_dtype == "fp8" and cfg.extract.quantize_on_server
        rate = m.rate(
            "extract_fp8_server_tokens_per_s" if fp8_server else "extract_bf16_tokens_per_s",
            "flops",
            notes,
            cites,
        )
        if cfg.extract.storage_dtype == "fp8" and not fp8_server:
            notes.append("fp8 quantized by the client: taken at the bf16 pipeline's rate (not measured)")
        rate *= servers
        start = m.server_start(notes, cites)
    else:
        flops = prefill_flops_per_token(m.target, cfg.corpus.max_length)
        compute = gpus * m.hw.peak_flops * MOE_PREFILL_MFU / flops
        from aerie.plan.disk import aux_layers, shard_bytes_per_token

        disk = (
            m.rate("disk_write_bytes_per_s", "bandwidth", notes, cites)
            if not m.scaled
            else m.rates["disk_write_bytes_per_s"].value
        )
        write = disk / shard_bytes_per_token(
            cfg.extract.storage_dtype,
            m.target.geometry.hidden_size,
            m.target.geometry.vocab_size,
            aux_layers(cfg, m.target),
        )
        rate = min(compute, write)
        notes.append(
            f"prefill at {MOE_PREFILL_MFU:.0%} of {gpus} x {m.hw.peak_flops / 1e12:.0f} TFLOP/s over "
            f"{flops / 1e9:.0f} GFLOP/token = {compute:,.0f} tokens/s; shard writes at the disk's rate = "
            f"{write:,.0f} tokens/s; the slower bounds"
        )
        start = m.server_start(notes, cites)
    seconds = start + tokens / rate
    from aerie.plan.disk import aux_layers, shard_bytes_per_token

    per_token = shard_bytes_per_token(
        cfg.extract.storage_dtype,
        m.target.geometry.hidden_size,
        m.target.geometry.vocab_size,
        aux_layers(cfg, m.target),
    )
    bound = roofline(m, rate, prefill_flops_per_token(m.target, cfg.corpus.max_length), gpus, per_token)
    return StageEstimate(
        "extract",
        seconds,
        gpus,
        f"{start:.0f} s start + {tokens:,} tokens / {rate:,.0f}/s",
        cites,
        notes,
        bound,
    )


def draft_flops(m: Model, seq_len: int) -> float:
    """Forward+backward FLOPs per trained token of the drafter this config trains (its family's count)."""
    train = m.cfg.train
    return family_of(train.drafter).flops_per_token(train.drafter, train, m.target.geometry, seq_len)


def _trained_positions(cfg: PipelineConfig, sizes: Sizes, world: int) -> tuple[int, int]:
    """(steps, positions computed): the training loop's steps, each a row of batch_tokens on each of
    `world` devices, every position computed whether it holds a token or an epoch's last row's padding
    (most of the work where an epoch fills a row or two, as the embedded default's does)."""
    t = cfg.train
    rows_per_epoch = math.ceil(sizes.train_tokens / max(t.epochs, 1e-9) / t.batch_tokens)
    steps = max(1, math.floor(t.epochs * rows_per_epoch / world))
    return steps, steps * world * t.batch_tokens


def _train(m: Model, sizes: Sizes) -> StageEstimate:
    cfg, notes, cites = m.cfg, [], []  # type: ignore[var-annotated]
    gpus = cfg.train.num_gpus if m.hw.gpu else 0
    steps, positions = _trained_positions(cfg, sizes, max(1, gpus))
    if positions > 1.05 * sizes.train_tokens:
        notes.append(
            f"{steps:,} steps of {cfg.train.batch_tokens:,}-token rows compute {positions:,} positions for "
            f"{sizes.train_tokens:,} tokens trained: each epoch's last row is padded"
        )
    # Sequences average about half the cap: attention is counted at max_length / 2.
    flops = draft_flops(m, cfg.train.max_length // 2)
    if not m.hw.gpu:
        achieved = m.rate("train_flops_per_s", "flops", notes, cites)
        rate = achieved / flops
        fixed = m.fixed("train", 0.0, notes, cites)
    elif m.same_target:
        # The benchmark's rate is per token trained: at its corpus's size, its padding is a fraction of a
        # percent of the positions.
        loop = m.rates["train_loop_s"].value
        rate = m.rate("train_tokens", "flops", notes, cites) / loop
        cites.append(m.rates["train_loop_s"].cite())
        fixed = m.rates["train_stage_s"].value - loop
    else:
        bench_seq = int(m.rates["train_bench_seq_len"].value)
        achieved = m.rate("train_kimi_tokens_per_s", "flops", notes, cites) * _kimi_bench_flops(bench_seq)
        rate = achieved / flops * max(1, gpus) * (MULTI_GPU_EFFICIENCY if gpus > 1 else 1.0)
        notes.append(
            f"the measured Kimi-sized drafter step's achieved FLOP/s over this config's {flops / 1e9:.1f} GFLOP/token"
            + (f", {gpus} GPUs at {MULTI_GPU_EFFICIENCY:.0%} scaling" if gpus > 1 else "")
        )
        fixed = SERVER_START_S
    if cfg.train.source == "online":
        # Its own extraction servers start before its first step: the extract stage's start-up.
        start = m.server_start(notes, cites) if m.hw.gpu else m.fixed("extract", 0.0, notes, cites)
        notes.append(f"online: the extraction servers start before the first step ({start:.0f} s)")
        fixed += start
    seconds = fixed + positions / rate
    return StageEstimate(
        "train",
        seconds,
        gpus,
        f"{fixed:.0f} s + {positions:,} positions / {rate:,.0f}/s",
        cites,
        notes,
        roofline(m, rate, flops, gpus, unit="positions"),
    )


def _kimi_bench_flops(seq_len: int) -> float:
    """FLOPs per token of the Kimi-sized drafter benchmarks/stages/train.py measured (its CONFIGS['kimi-k2.5'])."""
    return ttt_flops_per_token(7168, 56, 8, 128, 18432, 32000, seq_len, 7)


# The prompt-passes of the evaluate stage `evaluate_stage_s` measured: 80 MT-Bench and 40 held-out prompts,
# each decoded with eagle3 and prompt lookup at 3 and 7 steps, greedy.
EVAL_BENCH_PASSES = (80 + 40) * 2 * 2


def _eval_passes(cfg: PipelineConfig, sizes: Sizes) -> tuple[int, float]:
    """(prompt-passes, tokens per prompt): every prompt is decoded once per proposer, chain length and
    temperature; an answer is as long as the generation's mean answer, capped at max_new_tokens. The
    held-out prompts are the corpus's eval split, up to their limit."""
    from aerie.datasets import load_mtbench

    ev = cfg.evaluate
    prompts = 0
    for s in ev.prompt_sets():
        if s.kind == "mtbench":
            prompts += min(s.limit or len(load_mtbench()), len(load_mtbench()))
        elif s.kind == "heldout":  # the corpus's eval split, up to the limit
            prompts += min(s.limit or sizes.eval_records, sizes.eval_records)
        else:  # a file's prompts are not counted here: its limit, or as many as the held-out default
            prompts += s.limit or ev.heldout_samples
    passes = len(ev.proposers) * len(ev.num_steps) * len(ev.temperatures)
    mean_answer = sizes.completion_tokens / max(1, sizes.turns)
    return prompts * passes, min(ev.max_new_tokens, mean_answer) if mean_answer else ev.max_new_tokens


def _evaluate(m: Model, sizes: Sizes) -> StageEstimate:
    cfg, notes, cites = m.cfg, [], []  # type: ignore[var-annotated]
    prompt_passes, per_prompt = _eval_passes(cfg, sizes)
    tokens = prompt_passes * per_prompt
    gpus = 1 if m.hw.gpu else 0
    if not m.hw.gpu:
        eagle = m.rate("evaluate_eagle3_tokens_per_s", "bandwidth", notes, cites)
        lookup = m.rate("evaluate_prompt_lookup_tokens_per_s", "bandwidth", notes, cites)
        rate = 2 / (1 / eagle + 1 / lookup)
        notes.append("one prompt at a time (the record's batch size), the proposers' mean rate")
        fixed = m.fixed("evaluate", 0.0, notes, cites)
        notes.append("loading the target and drafter: in the calibration's speed factor")
    elif m.same_target:
        # The measured stage: EVAL_BENCH_PASSES prompt-passes at up to 384 new tokens, batches of 32.
        bench_start = m.measured_start(cites)
        stage_s = m.rate("evaluate_stage_s", "bandwidth", notes, cites)
        bench_tokens = EVAL_BENCH_PASSES * min(384, per_prompt)
        rate = bench_tokens / max(1.0, stage_s - bench_start) * cfg.evaluate.batch_size / 32
        notes.append("loading the target and drafter taken as long as a server start; batches scale the rate")
        fixed = bench_start
    else:
        steps = _weight_bound_steps(m, notes)
        rate = steps * cfg.evaluate.batch_size
        fixed = m.server_start(notes, cites)
    seconds = fixed + tokens / rate
    return StageEstimate(
        "evaluate",
        seconds,
        gpus,
        f"{fixed:.0f} s + {prompt_passes:,} prompt-passes x {per_prompt:.0f} tokens / {rate:,.1f}/s",
        cites,
        notes,
    )


def _weight_bound_steps(m: Model, notes: list[str]) -> float:
    """Decode steps/s of a large target served over server.tp_size GPUs: bound by reading its weights."""
    per_gpu = m.target.weight_bytes / m.cfg.server.tp_size
    notes.append(f"decode steps at half the rate of reading {per_gpu / 1e9:.0f} GB of weights per GPU")
    return 0.5 * m.hw.memory_bandwidth / per_gpu


def _deploy(m: Model, sizes: Sizes) -> StageEstimate:
    cfg, notes, cites = m.cfg, [], []  # type: ignore[var-annotated]
    d = cfg.deploy
    steps_per_level = sum(
        math.ceil(d.num_prompts / c) * d.max_new_tokens for c in d.concurrency
    )  # warm passes
    # Warm-up (`aerie.deploy.bench`): its requests one after another, then each level's workload once more.
    w = d.warmup_requests
    warmup = min(8, d.max_new_tokens) * w + steps_per_level if w else 0
    if not m.hw.gpu:
        steps = m.rate("decode_steps_per_s", "bandwidth", notes, cites)
        start = m.fixed("deploy", 0.0, notes, cites)
    elif m.same_target:
        steps = m.rate("decode_eager_steps_per_s", "bandwidth", notes, cites)
        start = m.server_start(notes, cites)
    else:
        steps = _weight_bound_steps(m, notes)
        start = m.server_start(notes, cites)
    notes.append(
        "the speculative server taken as fast as the baseline (its speed-up is what deploy measures)"
    )
    # Each level at steady state, `repeats` times: its window lasts level_seconds, longer where a slot's
    # requests_per_slot requests (one decode step a token) take more, plus one request's ramp before it.
    request_s = d.max_new_tokens / steps
    timed = (
        len(d.concurrency) * d.repeats * (max(d.level_seconds, d.requests_per_slot * request_s) + request_s)
    )
    per_server = start + warmup / steps + timed
    servers = 3 if cfg.server.backend == "sglang" and d.ngram != "off" else 2
    gpus = cfg.server.tp_size if m.hw.gpu else 0
    return StageEstimate(
        "deploy",
        servers * per_server,
        gpus,
        f"{servers} servers x ({start:.0f} s start + {warmup:,} warm-up decode steps / {steps:.1f}/s + "
        f"{timed:.0f} s timed: {len(d.concurrency)} levels x {d.repeats} runs)",
        cites,
        notes,
    )
