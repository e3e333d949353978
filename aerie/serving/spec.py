"""`ServerSpec`: everything needed to launch one model server, and `spec_for`, which builds it.

A spec is plain data: the argv (or the image and the argv run inside it), the port, the nonce the
server must echo back, the log file, the deadline. Launchers only read it, so the same spec can be
printed, tested and launched.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import aerie
from aerie.errors import ConfigError
from aerie.serving.config import WORKER_IMAGE, ServerConfig, is_sglang_image
from aerie.sglang_plugin.compat import ALLOW_UNTESTED_ENV, DEEPSEEK_V3_DEFAULTS, SUPPORTED_SGLANG

REFERENCE_MODULE = "aerie.engine"
CONTAINER_HF_CACHE = "/root/.cache/huggingface"
# aerie's source root (the checkout, for an editable install): SGLang's own environment lives beside it.
AERIE_ROOT = Path(aerie.__file__).resolve().parent.parent
# Where `make setup-sglang` links SGLang's own environment (Python 3.11, its own torch).
SGLANG_VENV = AERIE_ROOT / ".venv-sglang"
SGLANG_SETUP = "make setup-sglang"

# SGLang's CPU engine (server.device=cpu). In SGLang 0.5.23 `is_cpu()` holds only under this variable;
# without it `--device cpu` still takes CUDA code paths (rotary embedding imports vllm) and dies.
SGLANG_CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
# Its flags, each a default that the same flag in server.extra_args (or launch args) replaces.
SGLANG_CPU_ARGS: tuple[tuple[str, str | None], ...] = (
    # The one attention backend written in plain torch; the others are compiled CUDA (or AMX) kernels.
    ("--attention-backend", "torch_native"),
    # No CUDA graphs, per phase: SGLang 0.5.23 deprecates the one-switch --disable-cuda-graph for these.
    ("--cuda-graph-backend-decode", "disabled"),
    ("--cuda-graph-backend-prefill", "disabled"),
    # SGLang's warm-up is one more generation before "ready"; aerie's readiness runs its own
    # (/health_generate), and on a CPU each costs seconds.
    ("--skip-server-warmup", None),
    # SGLang sizes the KV pool from free device memory; on a CPU that is the host's RAM, shared with
    # everything else: a fixed pool instead.
    ("--max-total-tokens", "8192"),
    # With --chunked-prefill-size -1 (extraction) SGLang derives a negative static fraction on a CPU
    # and refuses to start ("Loaded weights leave no GPU memory for the KV cache").
    ("--mem-fraction-static", "0.3"),
)

# The deadline derived from the model size (see `startup_deadline`): a fixed part for what does not
# scale with the weights (interpreter and torch import, NCCL init, KV-cache allocation, CUDA-graph
# capture, warmup), plus the weights read at an assumed, deliberately pessimistic disk speed.
STARTUP_BASE_S = {"reference": 120.0, "sglang": 600.0}
UNKNOWN_SIZE_DEADLINE_S = 3600.0

Mode = Literal["serve", "extract"]


@dataclass(frozen=True)
class SpeculativeArgs:
    """SGLang speculative decoding with an EAGLE-3 drafter, or SGLang's own n-gram lookup
    (`algorithm="NGRAM"`, no drafter: drafts from the tokens already in the context). None fields:
    SGLang picks them."""

    draft_model_path: str | None = None
    num_steps: int | None = None
    eagle_topk: int | None = None
    num_draft_tokens: int | None = None
    algorithm: Literal["EAGLE3", "NGRAM"] = "EAGLE3"

    def __post_init__(self) -> None:
        if (self.algorithm == "EAGLE3") != (self.draft_model_path is not None):
            raise ConfigError(
                f"speculative algorithm {self.algorithm}: EAGLE3 takes a drafter directory, NGRAM none "
                f"(got {self.draft_model_path!r})"
            )

    def to_args(self) -> list[str]:
        args = ["--speculative-algorithm", self.algorithm]
        if self.draft_model_path is not None:
            args += ["--speculative-draft-model-path", self.draft_model_path]
        for flag, value in (
            ("--speculative-num-steps", self.num_steps),
            ("--speculative-eagle-topk", self.eagle_topk),
            ("--speculative-num-draft-tokens", self.num_draft_tokens),
        ):
            if value is not None:
                args += [flag, str(value)]
        return args


@dataclass(frozen=True)
class Requirement:
    """A distribution the server's interpreter must have, in a tested version, checked before launch."""

    distribution: str
    versions: tuple[str, ...]
    setup: str  # how to get it, for the message that refuses the launch
    allow_untested_env: str | None = None  # set to 1 there: any version is accepted


# SGLang's processes (setproctitle names) whose loss leaves its HTTP process unable to answer: the
# schedulers (one per rank, "sglang::scheduler_TP0..."), the detokenizer, the data-parallel controller,
# the tokenizer workers. The tokenizer manager runs in the HTTP process itself, whose exit is watched.
SGLANG_VITAL_PROCESSES = (
    "sglang::scheduler",
    "sglang::detokenizer",
    "sglang::data_parallel_controller",
    "sglang::tokenizer",
)
SGLANG_REQUIREMENT = Requirement(
    distribution="sglang",
    versions=SUPPORTED_SGLANG,
    setup=f"`{SGLANG_SETUP}` builds SGLang's own environment ({SGLANG_VENV.name}), or set server.python",
    allow_untested_env=ALLOW_UNTESTED_ENV,
)


@dataclass(frozen=True)
class ServerSpec:
    """One server launch. `image` set = a container running `command`; unset = a local process."""

    name: str
    command: list[str]
    model_path: str
    host: str
    port: int
    nonce: str
    log_path: Path
    startup_timeout_s: float
    # Environment values may hold secrets (HF_TOKEN): kept out of repr, never logged.
    env: dict[str, str] = field(default_factory=dict, repr=False)
    image: str | None = None
    module: str | None = None  # the Python module the interpreter must be able to import
    requires: Requirement | None = None  # what the interpreter must have installed (process launches)
    # The names (prefixes) of the child processes whose loss leaves a server that can no longer answer
    # (SGLang's schedulers, detokenizer, tokenizer workers). Other children may come and go: SGLang's
    # torch.compile'd MoE router runs short-lived compiler processes (g++) while it serves.
    vital_children: tuple[str, ...] = ()
    cwd: str | None = None  # working directory (docker: inside the container)
    dump_dir: Path | None = None
    clean_dump_dir: bool = False
    grace_s: float = 30.0
    poll_interval_s: float = 0.2
    sweep_shm: bool = True
    shm_dir: Path = Path("/dev/shm")
    # docker only
    gpus: int | None = None  # None = no GPU request, -1 = all
    shm_size: str | None = None
    memory_limit: str | None = None  # the container's memory (and swap) limit; None = the host's
    ipc_mode: str | None = "host"
    volumes: dict[str, str] = field(default_factory=dict)  # host path -> container path
    read_only_volumes: frozenset[str] = frozenset()  # host paths mounted read-only

    @property
    def weight_version(self) -> str:
        """The value the server must echo in `/server_info.weight_version`: proof it is ours."""
        return f"run-{self.nonce}"

    @property
    def client_host(self) -> str:
        """Where clients connect: a wildcard bind is reached through the loopback."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host

    @property
    def url(self) -> str:
        return f"http://{self.client_host}:{self.port}"

    @property
    def interpreter(self) -> str | None:
        """The Python running `module` (`python -m module ...`), if the command is one."""
        return self.command[0] if self.module and self.command else None

    def describe(self) -> str:
        """The launch in one line, without environment values (they may hold secrets)."""
        where = f"image {self.image}: " if self.image else ""
        return f"{where}{' '.join(self.command)}"

    def with_(self, **changes: object) -> ServerSpec:
        """A copy with some fields changed (tests and scenarios use this)."""
        return replace(self, **changes)  # type: ignore[arg-type]


def new_nonce() -> str:
    return uuid.uuid4().hex


def model_size_on_disk(model_path: str | os.PathLike[str]) -> int | None:
    """Bytes of weights under a local model dir (or file); None for a hub id that is not local."""
    path = Path(model_path).expanduser()
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return None
    total = 0
    for child in path.rglob("*"):
        if child.is_file():
            total += child.stat().st_size
    return total


def startup_deadline(
    size_bytes: int | None, backend: Literal["reference", "sglang"], read_mb_s: float = 200.0
) -> float:
    """Seconds a start may take: a fixed part for the backend + the weights at `read_mb_s`.

    reference: 120 s + size / 200 MB/s (SmolLM2-135M, 270 MB: ~121 s; the fixed part covers the torch
    import and warm-up on a busy 2-core machine). sglang: 600 s + size / 200 MB/s (Kimi-K2.5 INT4,
    ~595 GB: ~56 min; a fixed 15-minute wait would have given up on such a load). Unknown size
    (a hub id not on local disk): one hour. `ServerConfig.startup_timeout_s` overrides all of this.
    """
    if size_bytes is None:
        return UNKNOWN_SIZE_DEADLINE_S
    return STARTUP_BASE_S[backend] + size_bytes / (read_mb_s * 1e6)


def _default_log_path(name: str, nonce: str) -> Path:
    return Path(tempfile.gettempdir()) / "aerie-servers" / f"{name}-{nonce[:12]}.log"


def _reference_command(
    cfg: ServerConfig, python: str, model_path: str, weight_version: str, mode: Mode, dump_dir: Path | None
) -> list[str]:
    cmd = [python, "-m", REFERENCE_MODULE, "--model-path", model_path, "--port", str(cfg.port)]
    cmd += ["--host", cfg.host, "--weight-version", weight_version, "--mode", mode]
    if dump_dir is not None:
        cmd += ["--dump-dir", str(dump_dir)]
    if cfg.device != "auto":
        cmd += ["--device", cfg.device]
    return cmd


def _given_flags(args: list[str]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}


def sglang_cpu_args(given: list[str]) -> list[str]:
    """SGLang's CPU engine flags, less those `given` (the caller's own arguments) set already."""
    taken = _given_flags(given)
    args = ["--device", "cpu"]
    for flag, value in SGLANG_CPU_ARGS:
        if flag not in taken:
            args += [flag] if value is None else [flag, value]
    return args


def sglang_python(cfg: ServerConfig) -> str:
    """The interpreter a process launch of SGLang runs: server.python; else the one running aerie if
    SGLang is installed in it; else SGLang's own environment (`make setup-sglang`), if built. With
    neither, the one running aerie: the launch preflight then refuses it, naming the setup command."""
    if cfg.python:
        return cfg.python
    if importlib.util.find_spec("sglang") is None and (SGLANG_VENV / "bin" / "python").exists():
        return str(SGLANG_VENV / "bin" / "python")
    return sys.executable


def _with_aerie_on_path(env: dict[str, str]) -> dict[str, str]:
    """`env` whose PYTHONPATH also reaches aerie, after what it names (else what this process was given:
    the server's environment is laid over this one's, and an SGLang installed with `pip --target` is
    found only through it): SGLang's own environment does not install aerie, and the extraction
    launcher is aerie's module."""
    given = env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    paths = [p for p in given.split(os.pathsep) if p] + [str(AERIE_ROOT)]
    return {**env, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def _sglang_command(
    cfg: ServerConfig,
    python: str,
    module: str,
    model_path: str,
    weight_version: str,
    mode: Mode,
    host: str,
    given: list[str],
) -> list[str]:
    cmd = [python, "-m", module, "--model-path", model_path, "--host", host, "--port", str(cfg.port)]
    cmd += ["--weight-version", weight_version, "--tp-size", str(cfg.tp_size)]
    if cfg.device == "cpu":
        cmd += sglang_cpu_args(given)
    if mode == "extract":
        # Prefill-only requests of token ids; chunked prefill would split a sample's hidden states
        # across forward passes and the radix cache would skip the prefix of a repeated prompt.
        cmd += ["--skip-tokenizer-init", "--chunked-prefill-size", "-1", "--disable-radix-cache"]
    return cmd


def sglang_config_overrides(model_path: str, given: list[str]) -> list[str]:
    """`--json-model-override-args` with the DeepSeek-V3 fields SGLang 0.5.23's DeepSeek class reads and
    a config.json written by transformers lacks (`DEEPSEEK_V3_DEFAULTS`), for the top-level config or a
    wrapper's `text_config`. Every launch needs them, generation and serving included: the extraction
    plugin's own fix lives only in extraction servers. Nothing when the config has the fields, is not
    on this disk (a hub name), or the launch passes its own overrides."""
    if "--json-model-override-args" in {a.split("=", 1)[0] for a in given}:
        return []
    try:
        config = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return []

    def missing(cfg: dict) -> dict:
        if cfg.get("model_type") != "deepseek_v3":
            return {}
        return {k: v for k, v in DEEPSEEK_V3_DEFAULTS.items() if k not in cfg}

    text = config.get("text_config")
    overrides = missing(config) or (
        {"text_config": m} if isinstance(text, dict) and (m := missing(text)) else {}
    )
    return ["--json-model-override-args", json.dumps(overrides)] if overrides else []


def _container_volumes(
    cfg: ServerConfig, model_path: str, dump: Path | None, speculative: SpeculativeArgs | None
) -> tuple[dict[str, str], set[str]]:
    """What a container mounts (host path -> container path), and which mounts are read-only: the HF
    cache, and a local checkpoint, the dump dir and a local drafter each at their own path, so the
    argv stays valid inside."""
    volumes: dict[str, str] = {}
    read_only: set[str] = set()
    if cfg.hf_cache:
        volumes[str(Path(cfg.hf_cache).expanduser())] = CONTAINER_HF_CACHE
    local_model = Path(model_path).expanduser()
    if local_model.exists():
        volumes[str(local_model.resolve())] = str(local_model.resolve())
        read_only.add(str(local_model.resolve()))
    if dump is not None:
        volumes[str(dump)] = str(dump)
    if (
        speculative is not None
        and speculative.draft_model_path
        and Path(speculative.draft_model_path).exists()
    ):
        draft = str(Path(speculative.draft_model_path).resolve())
        volumes[draft] = draft
        read_only.add(draft)
    return volumes, read_only


# The attention backends SGLang 0.5.23 accepts for GPT-OSS (its attention sinks), in its own check
# (srt/arg_groups/model_hook.py); intel_amx is the one on a CPU and needs Intel AMX and sgl_kernel's
# CPU build, so the CPU engine's torch_native is refused.
SGLANG_GPT_OSS_BACKENDS = ("triton", "trtllm_mha", "fa3", "fa4", "ascend", "intel_amx", "intel_xpu", "aiter")


def refuse_on_cpu(model_path: str, given: list[str] | None = None) -> None:
    """Targets SGLang 0.5.23's CPU engine does not run, refused before a launch naming the ways that
    work. MLA (DeepSeek-V3, Kimi's backbone): without Intel AMX and sgl_kernel its CPU path takes
    another backend's handler, and its hidden states did not match a transformers forward. GPT-OSS:
    SGLang refuses the CPU engine's attention backend for the class (unless `given` names intel_amx)."""
    config = Path(model_path).expanduser() / "config.json"
    if not config.is_file():
        return
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError):
        return  # the server names what is wrong with it
    text = raw.get("text_config") or raw
    arch = (raw.get("architectures") or [raw.get("model_type", "?")])[0]
    ways = "Use server.backend=reference on the CPU, or SGLang on a GPU (server.device=cuda)"
    if text.get("kv_lora_rank") is not None:
        raise ConfigError(
            f"{model_path}: {arch} uses MLA attention (kv_lora_rank {text['kv_lora_rank']}), which SGLang "
            f"0.5.23 does not support on the CPU (its CPU MLA paths need Intel AMX and sgl_kernel). {ways}"
        )
    backend = _flag_value(given or [], "--attention-backend")
    if text.get("model_type") == "gpt_oss" and backend != "intel_amx":
        raise ConfigError(
            f"{model_path}: {arch} has attention sinks, which SGLang 0.5.23 runs only with the attention "
            f"backends {', '.join(SGLANG_GPT_OSS_BACKENDS)}; on the CPU that is intel_amx (Intel AMX and "
            f"sgl_kernel's CPU build), and SGLang refuses its CPU engine's torch_native for this model. {ways}"
        )


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value of the last `flag` in `args` (`--flag value` or `--flag=value`), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
    return value


def spec_for(
    cfg: ServerConfig,
    *,
    model_path: str,
    mode: Mode = "serve",
    name: str | None = None,
    nonce: str | None = None,
    dump_dir: str | os.PathLike[str] | None = None,
    clean_dump_dir: bool = False,
    log_path: str | os.PathLike[str] | None = None,
    speculative: SpeculativeArgs | None = None,
    model_size_bytes: int | None = None,
    module: str | None = None,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    trust_remote_code: bool = False,
) -> ServerSpec:
    """Build the launch of the configured backend for `model_path`.

    `trust_remote_code` (the target's own setting) adds `--trust-remote-code`, which both servers take:
    a target that ships its own modelling code (Kimi) does not load without it.

    `mode="extract"` starts the hidden-state extraction variant: the reference server with
    `--mode extract --dump-dir`, or SGLang through `cfg.sglang_extract_module` (aerie's plugin
    launcher; `module=` swaps it) with the extraction flags and `AERIE_DUMP_DIR` in its environment.
    """
    nonce = nonce or new_nonce()
    name = name or f"{cfg.backend}-{mode}"
    weight_version = f"run-{nonce}"
    dump = Path(dump_dir).expanduser().resolve() if dump_dir is not None else None
    docker = cfg.launcher == "docker"
    given = list(cfg.extra_args) + list(extra_args or [])
    if docker:
        python = cfg.container_python
    elif cfg.backend == "sglang":
        python = sglang_python(cfg)
    else:
        python = cfg.python or sys.executable
    server_env = {**cfg.env, **(env or {})}

    if cfg.backend == "reference":
        if docker and is_sglang_image(cfg.image):
            raise ConfigError(
                "server.launcher=docker runs SGLang; the reference server runs as a process "
                f"(or in aerie's worker image: server.image={WORKER_IMAGE})"
            )
        # In a container the server must listen on every interface for the published port to reach it.
        command = _reference_command(
            cfg.model_copy(update={"host": "0.0.0.0"}) if docker else cfg,
            python,
            model_path,
            weight_version,
            mode,
            dump,
        )
        if speculative is not None:
            if speculative.algorithm != "EAGLE3":
                raise ConfigError(
                    f"the reference server speculates with an EAGLE-3 drafter only, not "
                    f"{speculative.algorithm}; serve SGLang (server.backend=sglang) for n-gram speculation"
                )
            if speculative.eagle_topk is not None or speculative.num_draft_tokens is not None:
                raise ConfigError(
                    "the reference server decodes one speculative chain: it takes --speculative-num-steps "
                    "only (no topk / num_draft_tokens); use server.backend=sglang for tree drafts"
                )
            command += speculative.to_args()
        server_module = module or REFERENCE_MODULE
    else:
        if cfg.device == "cpu":
            refuse_on_cpu(model_path, given)
        server_module = module or (
            cfg.sglang_extract_module if mode == "extract" else cfg.sglang_serve_module
        )
        # In a container the server must listen on every interface for the published port to reach it.
        host = "0.0.0.0" if docker else cfg.host
        command = _sglang_command(cfg, python, server_module, model_path, weight_version, mode, host, given)
        command += sglang_config_overrides(model_path, given)
        if speculative is not None:
            command += speculative.to_args()
        # SGLang's warmup request goes to its own URL; a proxy in the environment breaks it (§6 #4).
        server_env.setdefault("no_proxy", "localhost,127.0.0.1,0.0.0.0")
        if cfg.device == "cpu":
            server_env.update(SGLANG_CPU_ENV)
        if not docker and server_module.startswith("aerie."):
            server_env = _with_aerie_on_path(server_env)
        if mode == "extract" and dump is not None:
            server_env["AERIE_DUMP_DIR"] = str(dump)
    if trust_remote_code:
        command.append("--trust-remote-code")
    command += given

    if cfg.startup_timeout_s is not None:
        deadline = cfg.startup_timeout_s
    else:
        size = model_size_bytes if model_size_bytes is not None else model_size_on_disk(model_path)
        deadline = startup_deadline(size, cfg.backend, cfg.startup_read_mb_s)
    volumes, read_only = _container_volumes(cfg, model_path, dump, speculative) if docker else ({}, set())

    return ServerSpec(
        name=name,
        command=command,
        model_path=model_path,
        host=cfg.host,
        port=cfg.port,
        nonce=nonce,
        log_path=Path(log_path) if log_path is not None else _default_log_path(name, nonce),
        startup_timeout_s=deadline,
        env=server_env,
        image=cfg.image if docker else None,
        module=server_module,
        requires=SGLANG_REQUIREMENT if cfg.backend == "sglang" and not docker else None,
        vital_children=SGLANG_VITAL_PROCESSES if cfg.backend == "sglang" else (),
        dump_dir=dump,
        clean_dump_dir=clean_dump_dir,
        grace_s=cfg.grace_s,
        poll_interval_s=cfg.poll_interval_s,
        sweep_shm=cfg.sweep_shm,
        shm_dir=Path(cfg.shm_dir),
        # A server on the CPU asks for no GPU: a host without a GPU runtime refuses any request for one.
        gpus=cfg.gpus if docker and cfg.device != "cpu" else None,
        shm_size=cfg.shm_size if docker else None,
        memory_limit=cfg.memory_limit if docker else None,
        volumes=volumes,
        read_only_volumes=frozenset(read_only),
    )
