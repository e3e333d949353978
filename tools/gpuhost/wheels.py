"""Which wheels the host needs (aerie's requirements minus the host image) and their download here."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from aerie.errors import ConfigError, HostSetupError

# The Python packages of the GPU hosts' image ('cuda'), as the device notes list them (read 2026-11-17).
# Anything aerie needs that is not here is shipped as a wheel.
_HOST_PACKAGE_LIST = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
    jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
    onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
    scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
    torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
    wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"""
HOST_PACKAGES = frozenset(_HOST_PACKAGE_LIST.split())
# What `aerie run --no-prefect` imports beyond the host image.
BASE_ROOTS = ("pydantic", "pydantic-settings", "python-dotenv", "polars", "fastapi", "uvicorn", "gguf")
EXTRAS = {"s3": ("boto3",), "prefect": ("prefect",)}
# Shipped even though the host has it: pydantic needs a recent typing-extensions and the host's version is
# not known; a newer typing-extensions is backwards compatible with everything else there.
ALWAYS_SHIP = frozenset({"typing-extensions"})
# pip matches manylinux tags exactly; the host runs glibc 2.39 (Ubuntu 24.04, Python 3.12.3).
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + ["manylinux2014_x86_64", "linux_x86_64"]


def normalize(name: str) -> str:
    """PEP 503 name: what pip and the host's package list compare."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_pins(
    roots: Iterable[str], host: frozenset[str] = HOST_PACKAGES, python_version: str = "3.12"
) -> dict[str, str]:
    """The distributions to ship and their versions: `roots` and their requirements (markers evaluated
    for CPython `python_version` on x86-64 Linux, extras ignored), minus what the host image holds,
    pinned to the versions installed in this interpreter (the versions aerie is tested with)."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    env = {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "extra": "",
    }
    pins: dict[str, str] = {}
    todo = [normalize(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in pins or (name in host and name not in ALWAYS_SHIP):
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise ConfigError(
                f"{name} is needed on the GPU host but is not installed here, so its version cannot be "
                "pinned; install it in this environment first"
            ) from None
        pins[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(normalize(req.name))
    for name in ALWAYS_SHIP:
        with contextlib.suppress(md.PackageNotFoundError):
            pins.setdefault(name, md.version(name))
    return dict(sorted(pins.items()))


def wheel_key(filename: str) -> tuple[str, str]:
    """(normalized name, version) of a wheel file name."""
    name, version = filename.split("-")[:2]
    return normalize(name), version


def _downloaded(dest: Path) -> dict[tuple[str, str], Path]:
    return {wheel_key(p.name): p for p in dest.glob("*.whl")}


def download_wheels(pins: dict[str, str], dest: Path, python_version: str) -> list[Path]:
    """One wheel per pin, for CPython `python_version` on manylinux x86-64; already-downloaded ones are
    reused, so a failed stage re-runs quickly."""
    dest.mkdir(parents=True, exist_ok=True)
    found = _downloaded(dest)
    abi = "cp" + python_version.replace(".", "")
    wheels = []
    for name, version in pins.items():
        if (name, version) not in found:
            cmd = [
                sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                "--python-version", python_version, "--implementation", "cp",
                "--abi", abi, "--abi", "abi3", "--abi", "none",
                *(arg for p in PLATFORMS for arg in ("--platform", p)), "--platform", "any",
                "-d", str(dest), f"{name}=={version}",
            ]  # fmt: skip
            print(f"downloading {name}=={version}", flush=True)
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise HostSetupError(
                    f"pip could not download {name}=={version} for CPython {python_version} on x86-64 "
                    f"Linux:\n{done.stderr.strip()[-2000:]}"
                )
            found = _downloaded(dest)
        if (name, version) not in found:
            raise HostSetupError(f"pip reported success but no wheel for {name}=={version} is in {dest}")
        wheels.append(found[(name, version)])
    return wheels
