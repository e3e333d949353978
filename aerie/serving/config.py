"""Configuration of a model server (reference server as a process, or SGLang in Docker)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from aerie.configbase import StrictModel


class ServerConfig(StrictModel):
    """How the pipeline launches and waits for a model server."""

    backend: Literal["reference", "sglang"] = Field(
        "reference",
        description="reference: aerie's transformers server; sglang: SGLang (with aerie's plugin).",
    )
    launcher: Literal["process", "docker"] = Field(
        "process", description="Run as a local process or a container."
    )
    python: str = Field("python", description="Interpreter for the process launcher (checked before launch).")
    image: str = Field("aerie/sglang-extract:latest", description="Container image for the docker launcher.")
    host: str = Field("127.0.0.1", description="Host the server binds.")
    port: int = Field(
        30000, ge=1, le=65535, description="HTTP port; refused if something already answers there."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Reference server device.")
    tp_size: int = Field(1, ge=1, description="Tensor parallel size (SGLang).")
    gpus: int = Field(-1, description="GPUs given to the container (-1 = all).")
    shm_size: str = Field("32g", description="Container /dev/shm size.")
    startup_timeout_s: float | None = Field(
        None, gt=0, description="Readiness deadline; None = derived from the model's size on disk."
    )
    extra_args: list[str] = Field(
        default_factory=list, description="Extra server arguments, appended verbatim."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the server.")
