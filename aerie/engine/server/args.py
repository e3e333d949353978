"""Command line of the reference server: the SGLang flags aerie uses, plus its own.

Flag names follow SGLang (`--model-path`, `--port`, `--weight-version`, `--served-model-name`, ...) so a
launcher builds the same command for both backends. Everything that can be checked without the model
is checked here, before the (slow) load: a bad flag must fail in a second, not after the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from aerie.errors import ConfigError
from aerie.families import serving
from aerie.reasoning import PARSERS

Mode = Literal["serve", "extract"]


class ArgsError(ValueError):
    """A command-line value that cannot work; the message names the flag."""


@dataclass(frozen=True)
class RefServerArgs:
    """The parsed command line. `aux_layers` is None until the model's depth is known."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    weight_version: str = "default"
    served_model_name: str | None = None
    mode: Mode = "serve"
    dump_dir: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    max_batch_tokens: int = 16384
    max_running_requests: int = 64
    max_total_tokens: int | None = None  # KV cache cells (rows x positions); None: from device memory
    mem_fraction_static: float = 0.8
    unhealthy_after: int = 3
    dump_writers: int = 2
    gil_switch_us: int = 0
    trace_packs: str | None = None  # "SKIP:COUNT" (aerie.engine.server.trace)
    trace_dir: str | None = None
    dump_dtype: Literal["model", "fp8"] = "model"
    decode_backend: Literal["auto", "slots", "batched"] = "auto"
    cuda_graphs: bool = False
    cpu_threads: int = 0
    aux_layers: tuple[int, ...] | None = None
    skip_tokenizer_init: bool = False
    disable_radix_cache: bool = False
    chunked_prefill_size: int = -1
    random_seed: int | None = None
    trust_remote_code: bool = False
    health_check_timeout_s: float = 20.0
    warmup_delay_s: float = 0.0
    skip_server_warmup: bool = False
    log_level: str = "info"
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    launch_command: tuple[str, ...] = field(default_factory=tuple)

    def resolved_dict(self) -> dict[str, Any]:
        """The flat field dict `/server_info` starts from (like SGLang's `ServerArgs.resolved_dict`)."""
        out = asdict(self)
        out["aux_layers"] = list(self.aux_layers) if self.aux_layers is not None else None
        out.pop("launch_command")
        return out

    def to_argv(self) -> list[str]:
        """The flags that reproduce these args (used by tests and launchers)."""
        argv = ["--model-path", self.model_path, "--host", self.host, "--port", str(self.port)]
        argv += ["--weight-version", self.weight_version, "--mode", self.mode]
        argv += ["--device", self.device, "--dtype", self.dtype]
        argv += ["--max-batch-tokens", str(self.max_batch_tokens)]
        argv += ["--max-running-requests", str(self.max_running_requests)]
        if self.max_total_tokens is not None:
            argv += ["--max-total-tokens", str(self.max_total_tokens)]
        argv += ["--mem-fraction-static", str(self.mem_fraction_static)]
        argv += ["--unhealthy-after", str(self.unhealthy_after)]
        argv += ["--dump-writers", str(self.dump_writers)]
        argv += ["--gil-switch-us", str(self.gil_switch_us)]
        if self.trace_packs and self.trace_dir:
            argv += ["--trace-packs", self.trace_packs, "--trace-dir", self.trace_dir]
        argv += ["--dump-dtype", self.dump_dtype]
        argv += ["--decode-backend", self.decode_backend]
        if self.cuda_graphs:
            argv.append("--cuda-graphs")
        argv += ["--cpu-threads", str(self.cpu_threads)]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        if self.dump_dir:
            argv += ["--dump-dir", self.dump_dir]
        if self.aux_layers is not None:
            argv += ["--aux-layers", *map(str, self.aux_layers)]
        if self.skip_tokenizer_init:
            argv.append("--skip-tokenizer-init")
        if self.warmup_delay_s:
            argv += ["--warmup-delay-s", str(self.warmup_delay_s)]
        if self.reasoning_parser:
            argv += ["--reasoning-parser", self.reasoning_parser]
        if self.chat_template:
            argv += ["--chat-template", self.chat_template]
        return argv


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m aerie.engine",
        description="aerie's reference model server: the SGLang HTTP subset aerie uses, on transformers.",
        allow_abbrev=False,
    )
    p.add_argument("--model-path", "--model", required=True, help="HF-format model directory.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument(
        "--weight-version", default="default", help="Free-form; echoed by /server_info (launch nonce)."
    )
    p.add_argument("--served-model-name", default=None, help="Name in /v1/models (default: model path).")
    p.add_argument(
        "--mode",
        choices=["serve", "extract"],
        default="serve",
        help="extract: prefill-only /generate requests write hidden-state dumps to --dump-dir.",
    )
    p.add_argument("--dump-dir", default=None, help="Where extract mode writes <rid>.safetensors.")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="auto = bfloat16 on CUDA, float32 on CPU.",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=16384,
        help="Tokens per packed extraction forward, and the prompt-token budget of a generation batch.",
    )
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=64,
        help="Sequences decoded together at most; the slot decoder lowers it where that many rows at the "
        "full context would not fit its KV cache (logged).",
    )
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="Slot decoder: the KV cache's size in cells (rows x positions). Default: from the memory "
        "--mem-fraction-static leaves it.",
    )
    p.add_argument(
        "--mem-fraction-static",
        type=float,
        default=0.8,
        help="Slot decoder without --max-total-tokens: on CUDA the fraction of the card that weights and "
        "KV cache together may take (SGLang's meaning; the rest is for activations and CUDA graphs); on the "
        "CPU the fraction of the host's available memory the KV cache may take.",
    )
    p.add_argument(
        "--unhealthy-after",
        type=int,
        default=3,
        help="Failed model steps in a row after which the server reports itself unhealthy for good "
        "(/health 503 with the reason) so that its launcher restarts it.",
    )
    p.add_argument(
        "--dump-writers",
        type=int,
        default=2,
        help="Extraction: threads writing dump files; each writes one pack at a time, and at most this many "
        "+ 1 captured packs wait for them (back-pressure).",
    )
    p.add_argument(
        "--gil-switch-us",
        type=int,
        default=0,
        help="The interpreter's thread switch interval (sys.setswitchinterval) in microseconds; 0 keeps "
        "Python's 5,000. Every torch call releases the GIL and must win it back: a shorter interval makes "
        "the model thread wait less for the HTTP and dump-writer threads between kernel launches. (In an "
        "H200 extraction 1,000 made no difference: benchmarks/results/extract_gil-h200.json.)",
    )
    p.add_argument(
        "--dump-dtype",
        choices=["model", "fp8"],
        default="model",
        help="Extraction: model = dumps hold the model dtype; fp8 = quantized on the device before the "
        "copy to the host (float8_e4m3fn codes + per-token power-of-two scales aux_scale/last_scale, the fp8 "
        "shard scheme): half the bytes copied, written and read.",
    )
    p.add_argument(
        "--decode-backend",
        default="auto",
        choices=["auto", "slots", "batched"],
        help="slots: a preallocated KV cache with one row per request (Llama-family models); batched: "
        "transformers' DynamicCache (any model); auto: slots where the model qualifies.",
    )
    p.add_argument(
        "--trace-packs",
        default=None,
        metavar="SKIP:COUNT",
        help="Extraction: profile packs SKIP..SKIP+COUNT-1 (torch.profiler, every thread and the device) "
        "into --trace-dir: a Chrome trace, the ops by self time, and each device stream's busy time and "
        "gaps (aerie.engine.server.trace).",
    )
    p.add_argument("--trace-dir", default=None, help="Where --trace-packs writes.")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="Slot decoder on CUDA: replay each decoding step as a CUDA graph (one per cache-width "
        "bucket, checked against the eager step on first use; falls back to eager on any failure).",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=0,
        help="torch intra-op threads; 0 = half the cores (at most 8). Decoding a small model is "
        "latency-bound: extra threads mostly wait on each other, badly so on a shared host.",
    )
    p.add_argument(
        "--aux-layers",
        type=int,
        nargs="+",
        default=None,
        help="EAGLE-3 capture, input-of-layer convention (= HF hidden_states[i]); default [2, N//2, N-3].",
    )
    p.add_argument(
        "--skip-tokenizer-init", action="store_true", help="Accept input_ids only (no text, no chat)."
    )
    p.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="Accepted for SGLang parity; the reference server never reuses a prefix (cached_tokens is 0).",
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=-1,
        help="Accepted for SGLang parity; only -1 (no chunking) exists here.",
    )
    p.add_argument("--random-seed", type=int, default=None, help="Seed for sampling (default: random).")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument(
        "--health-check-timeout",
        dest="health_check_timeout_s",
        type=float,
        default=float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20)),
        help="/health returns 503 when no model step completes within this many seconds.",
    )
    p.add_argument(
        "--warmup-delay-s",
        type=float,
        default=0.0,
        help="Testing aid: hold /health at 503 this long after the port opens, before the warm-up.",
    )
    p.add_argument("--skip-server-warmup", action="store_true", help="Mark the server up without a warm-up.")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(PARSERS),
        help="Split a thinking model's reasoning into message.reasoning_content (SGLang's names; the "
        "corpus splits inline reasoning by the same rule, aerie.reasoning).",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="A Jinja chat template file used instead of the tokenizer's (/v1/chat/completions).",
    )
    spec = p.add_argument_group("speculative decoding (served by aerie.engine.speculative.decoder)")
    spec.add_argument(
        "--speculative-algorithm",
        default=None,
        help="A drafter family's algorithm (aerie.families: Family.served_algorithm), e.g. EAGLE3.",
    )
    spec.add_argument("--speculative-draft-model-path", "--speculative-draft-model", default=None)
    spec.add_argument("--speculative-num-steps", type=int, default=None)
    return p


def parse_args(argv: Sequence[str]) -> RefServerArgs:
    """Parse and check everything that does not need the model; raise ArgsError naming the flag."""
    ns = build_parser().parse_args(list(argv))
    args = RefServerArgs(
        model_path=ns.model_path,
        host=ns.host,
        port=ns.port,
        weight_version=ns.weight_version,
        served_model_name=ns.served_model_name,
        mode=ns.mode,
        dump_dir=ns.dump_dir,
        device=ns.device,
        dtype=ns.dtype,
        max_batch_tokens=ns.max_batch_tokens,
        max_running_requests=ns.max_running_requests,
        max_total_tokens=ns.max_total_tokens,
        mem_fraction_static=ns.mem_fraction_static,
        unhealthy_after=ns.unhealthy_after,
        dump_writers=ns.dump_writers,
        gil_switch_us=ns.gil_switch_us,
        trace_packs=ns.trace_packs,
        trace_dir=ns.trace_dir,
        dump_dtype=ns.dump_dtype,
        decode_backend=ns.decode_backend,
        cuda_graphs=ns.cuda_graphs,
        cpu_threads=ns.cpu_threads,
        aux_layers=tuple(ns.aux_layers) if ns.aux_layers is not None else None,
        skip_tokenizer_init=ns.skip_tokenizer_init,
        disable_radix_cache=ns.disable_radix_cache,
        chunked_prefill_size=ns.chunked_prefill_size,
        random_seed=ns.random_seed,
        trust_remote_code=ns.trust_remote_code,
        health_check_timeout_s=ns.health_check_timeout_s,
        warmup_delay_s=ns.warmup_delay_s,
        skip_server_warmup=ns.skip_server_warmup,
        log_level=ns.log_level,
        speculative_algorithm=ns.speculative_algorithm,
        speculative_draft_model_path=ns.speculative_draft_model_path,
        speculative_num_steps=ns.speculative_num_steps,
        reasoning_parser=ns.reasoning_parser,
        chat_template=ns.chat_template,
        launch_command=tuple(argv),
    )
    check_args(args)
    return args


def check_args(args: RefServerArgs) -> None:
    if not (Path(args.model_path).expanduser() / "config.json").is_file():
        raise ArgsError(f"--model-path {args.model_path}: no config.json there (an HF-format directory)")
    if not 1 <= args.port <= 65535:
        raise ArgsError(f"--port {args.port}: not a TCP port")
    if (
        min(args.max_batch_tokens, args.max_running_requests, args.dump_writers) < 1
        or min(args.cpu_threads, args.gil_switch_us) < 0
    ):
        raise ArgsError(
            "--max-batch-tokens, --max-running-requests and --dump-writers must be positive, --cpu-threads "
            "and --gil-switch-us >= 0"
        )
    if args.max_total_tokens is not None and args.max_total_tokens < 1:
        raise ArgsError(f"--max-total-tokens {args.max_total_tokens}: must be positive")
    if not 0 < args.mem_fraction_static <= 1:
        raise ArgsError(f"--mem-fraction-static {args.mem_fraction_static}: must be in (0, 1]")
    if args.unhealthy_after < 1:
        raise ArgsError(f"--unhealthy-after {args.unhealthy_after}: must be at least 1")
    if args.chunked_prefill_size != -1:
        raise ArgsError(
            f"--chunked-prefill-size {args.chunked_prefill_size}: the reference server never chunks; use -1"
        )
    if args.mode == "extract":
        _check_dump_dir(args.dump_dir)
    elif args.dump_dtype != "model":
        raise ArgsError(f"--dump-dtype {args.dump_dtype}: only --mode extract writes dumps")
    if args.trace_packs is not None:
        _check_trace(args)
    if args.aux_layers is not None:
        if len(set(args.aux_layers)) != len(args.aux_layers):
            raise ArgsError(f"--aux-layers {list(args.aux_layers)}: ids must be unique")
        depth = config_depth(args.model_path)
        if depth is not None:
            check_aux_layers(args.aux_layers, depth)
    if args.chat_template is not None and not Path(args.chat_template).expanduser().is_file():
        raise ArgsError(f"--chat-template {args.chat_template}: no such file (a Jinja template)")
    if args.speculative_algorithm is not None:
        if not args.speculative_draft_model_path:
            raise ArgsError("--speculative-algorithm needs --speculative-draft-model-path")
        try:
            serving(args.speculative_algorithm)
        except ConfigError as exc:
            raise ArgsError(f"--speculative-algorithm: {exc}") from exc


def parse_packs(spec: str) -> tuple[int, int]:
    """`--trace-packs SKIP:COUNT` -> (skip, count); ValueError with the reason otherwise."""
    try:
        skip, count = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--trace-packs wants SKIP:COUNT (two integers), got {spec!r}") from None
    if skip < 0 or count < 1:
        raise ValueError(f"--trace-packs {spec!r}: SKIP must be >= 0 and COUNT >= 1")
    return skip, count


def _check_trace(args: RefServerArgs) -> None:
    if args.mode != "extract":
        raise ArgsError("--trace-packs: only --mode extract runs packs")
    if not args.trace_dir:
        raise ArgsError("--trace-packs needs --trace-dir (where the trace is written)")
    try:
        parse_packs(args.trace_packs or "")
    except ValueError as exc:
        raise ArgsError(str(exc)) from exc


def _check_dump_dir(dump_dir: str | None) -> None:
    if not dump_dir:
        raise ArgsError("--mode extract needs --dump-dir (where <rid>.safetensors files are written)")
    path = Path(dump_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ArgsError(f"--dump-dir {dump_dir}: cannot create it: {exc}") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ArgsError(f"--dump-dir {dump_dir}: not writable")


def config_depth(model_path: str) -> int | None:
    """num_hidden_layers from config.json (or its text_config), read without loading the model."""
    try:
        raw = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    depth = (raw.get("text_config") or {}).get("num_hidden_layers", raw.get("num_hidden_layers"))
    return int(depth) if isinstance(depth, int) else None


def check_aux_layers(aux_layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Input-of-layer ids must name a residual stream that exists: 0 (embeddings) .. N-1."""
    bad = [i for i in aux_layers if not 0 <= i < num_layers]
    if bad:
        raise ArgsError(
            f"--aux-layers {list(aux_layers)}: {bad} out of range for a {num_layers}-layer model "
            f"(input-of-layer convention: 0..{num_layers - 1})"
        )
    return tuple(aux_layers)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's capture: the residual stream entering layers 2, N//2 and N-3."""
    return (2, num_layers // 2, num_layers - 3)


def cpu_threads(requested: int) -> int:
    """The torch thread count: as asked, or half the cores (at most 8)."""
    return requested or max(1, min(8, (os.cpu_count() or 2) // 2))


def launch_command(argv: Sequence[str]) -> str:
    """The launch command for /server_info. No flag of this server carries a secret, so none is redacted."""
    return shlex.join(["python", "-m", "aerie.engine", *argv])
