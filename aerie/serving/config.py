"""Configuration of a model server (reference server as a process, or SGLang in Docker)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from aerie.configbase import StrictModel


class ServerConfig(StrictModel):
    """How the pipeline launches, waits for and tears down a model server."""

    backend: Literal["reference", "sglang"] = Field(
        "reference",
        description="reference: aerie's transformers server; sglang: SGLang (with aerie's plugin).",
    )
    launcher: Literal["process", "docker"] = Field(
        "process", description="Run as a local process or a container."
    )
    python: str | None = Field(
        None,
        description="Interpreter for the process launcher (checked before launch). None = the one running "
        "aerie; for SGLang, that one if it has SGLang, else SGLang's own environment (.venv-sglang beside "
        "aerie's source, built by `make setup-sglang`).",
    )
    container_python: str = Field("python3", description="Interpreter inside the container image.")
    image: str = Field("aerie/sglang-extract:latest", description="Container image for the docker launcher.")
    host: str = Field("127.0.0.1", description="Host the server binds (docker: the host side of the port).")
    port: int = Field(
        30000, ge=1, le=65535, description="HTTP port; refused if something already answers there."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="The reference server's torch device. For SGLang, cpu = its CPU engine "
        "(SGLANG_USE_CPU_ENGINE=1, --device cpu, torch-native attention, no CUDA graphs, a fixed KV pool: "
        "aerie.serving.spec.SGLANG_CPU_ARGS, each replaced by the same flag in extra_args); auto and cuda "
        "leave SGLang on its default, the GPU.",
    )
    tp_size: int = Field(1, ge=1, description="Tensor parallel size (SGLang).")
    gpus: int = Field(
        -1, description="GPUs given to the container (-1 = all); none when server.device is cpu."
    )
    shm_size: str = Field("32g", description="Container /dev/shm size.")
    memory_limit: str | None = Field(
        None, description="Container memory limit (docker's units: 2g, 512m); an OOM kill is reported as one."
    )
    hf_cache: str | None = Field(
        "~/.cache/huggingface",
        description="Host HF cache mounted into the container at /root/.cache/huggingface (None = none).",
    )
    startup_timeout_s: float | None = Field(
        None, gt=0, description="Readiness deadline; None = derived from the model's size on disk."
    )
    startup_read_mb_s: float = Field(
        200.0,
        gt=0,
        description="Assumed weight-loading speed (MB/s) used to derive the deadline from the model size.",
    )
    grace_s: float = Field(
        30.0,
        ge=0,
        description="Seconds between SIGTERM and SIGKILL at teardown (SGLang drains up to ~15 s, then reaps).",
    )
    poll_interval_s: float = Field(
        0.2, gt=0, le=5, description="Readiness poll interval (readiness is noticed within one interval)."
    )
    sweep_shm: bool = Field(
        True, description="After teardown, unlink SGLang /dev/shm segments left by dead processes."
    )
    shm_dir: str = Field("/dev/shm", description="Where SGLang leaves shared-memory segments.")
    sglang_serve_module: str = Field(
        "sglang.launch_server", description="Module that starts SGLang for serving."
    )
    sglang_extract_module: str = Field(
        "aerie.sglang_plugin.launch",
        description="Module that starts SGLang with aerie's hidden-state dump plugin (extraction).",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="Extra server arguments, appended verbatim."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the server.")


Launch = Literal["generate", "extract", "deploy"]
ALL_LAUNCHES: frozenset[Launch] = frozenset({"generate", "extract", "deploy"})
_EXTRACT: frozenset[Launch] = frozenset({"extract"})
_DEPLOY: frozenset[Launch] = frozenset({"deploy"})

# Flags aerie puts on a server's command line itself, each from one config field (or its own
# bookkeeping), and the launches that get it: generation's reference server, extraction's, deployment's.
OWN_FLAGS: dict[str, tuple[str, frozenset[Launch]]] = {
    "--model-path": ("target.name", ALL_LAUNCHES),
    "--model": ("target.name", ALL_LAUNCHES),
    "--host": ("server.host", ALL_LAUNCHES),
    "--port": ("server.port", ALL_LAUNCHES),
    "--weight-version": ("aerie itself (the launch nonce the readiness check expects)", ALL_LAUNCHES),
    "--mode": ("aerie itself (serve or extract)", ALL_LAUNCHES),
    "--device": ("server.device", ALL_LAUNCHES),
    "--trust-remote-code": ("target.trust_remote_code", ALL_LAUNCHES),
    "--tp-size": ("server.tp_size", ALL_LAUNCHES),
    "--tensor-parallel-size": ("server.tp_size", ALL_LAUNCHES),
    "--dump-dir": ("extract.dump_dir", _EXTRACT),
    "--max-batch-tokens": ("extract.batch_tokens", _EXTRACT),
    "--dump-dtype": ("extract.quantize_on_server", _EXTRACT),
    "--skip-tokenizer-init": ("aerie itself (extraction sends token ids)", _EXTRACT),
    "--chunked-prefill-size": ("aerie itself (extraction needs whole prefills: -1)", _EXTRACT),
    "--disable-radix-cache": ("aerie itself (extraction needs every prefix computed)", _EXTRACT),
    "--speculative-algorithm": ("aerie itself (EAGLE3, for the deployed drafter)", _DEPLOY),
    "--speculative-draft-model-path": ("aerie itself (the trained drafter)", _DEPLOY),
    "--speculative-num-steps": ("deploy.num_steps", _DEPLOY),
    "--speculative-eagle-topk": ("deploy.eagle_topk", _DEPLOY),
    "--speculative-num-draft-tokens": ("deploy.num_draft_tokens", _DEPLOY),
}


def flag_conflict(where: str, args: list[str], launches: frozenset[Launch] | set[str]) -> str | None:
    """Why `args` (the config list `where`, passed to `launches`) give a flag aerie sets itself, or None."""
    for arg in args:
        flag = arg.split("=", 1)[0]
        owner = OWN_FLAGS.get(flag)
        if owner is not None and owner[1] & launches:
            source = owner[0]
            fix = f"set {source} instead" if "." in source and " " not in source else "leave it out"
            return f"{where} gives {flag}, which aerie already sets from {source}: one would silently win ({fix})"
    return None


WORKER_IMAGE = "aerie/worker-cpu:latest"


def is_sglang_image(image: str) -> bool:
    """An SGLang image (lmsysorg/sglang, aerie/sglang-extract...) has SGLang but not aerie's own server."""
    return "sglang" in image.rsplit("/", 1)[-1]


def launcher_problem(cfg: ServerConfig) -> str | None:
    """Why this launcher cannot run this backend, or None (checked at load; `spec_for` checks again)."""
    if cfg.launcher == "docker" and cfg.backend != "sglang" and is_sglang_image(cfg.image):
        return (
            f"server.launcher 'docker' runs SGLang, not server.backend {cfg.backend!r}: the reference "
            f"server runs as a process, or in an image with aerie (server.image '{WORKER_IMAGE}'); "
            "or set server.backend 'sglang'"
        )
    return None
