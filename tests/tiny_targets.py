"""Tiny random-weight targets of every architecture aerie handles, built in the tests with transformers
(seeded, saved with `save_pretrained`): Llama-3, Qwen3, Qwen3-MoE, DeepSeek-V3, a Kimi-shaped one
(DeepSeek-V3 backbone, Kimi's tiktoken tokenizer as its own code, the K2.5-style thinking template of tests/fixtures/chat_templates) and
GPT-OSS. Each keeps what makes its architecture itself at toy sizes: Qwen3's head_dim != hidden/heads,
MoE routing, MLA's latent and rope key of different widths, GPT-OSS's attention sinks and sliding
layers, Llama-3's and YaRN's RoPE scaling. Import-side-effect free.

The tokenizers are real ones: the embedded SmolLM2's (vocabulary 49152) for all but the Kimi-shaped
target, whose tokenizer is `tests/tiny_kimi/tokenization_kimi.py` over a small byte-pair vocabulary
built here, with Kimi's special tokens at Kimi's offsets from the base vocabulary.
"""

from __future__ import annotations

import base64
import collections
import json
import shutil
from pathlib import Path
from typing import Any

ARCHITECTURES = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3", "kimi", "gpt_oss")
MLA = frozenset({"deepseek_v3", "kimi"})
KIMI_DIR = Path(__file__).resolve().parent / "tiny_kimi"
LAYERS = 8  # EAGLE-3 captures the inputs of layers 2, 4, 5: three distinct residual streams
SEED = 0

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
# The MLA shape of DeepSeek-V3 and Kimi at toy size: q/kv LoRA ranks, a rope key narrower than the
# nope part, a value head of yet another width; one dense layer first, then routed + shared experts.
_MLA: dict[str, Any] = {
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
}
# DeepSeek-V3's own MLA head widths (latent 512, rope key 64, nope and value 128) on the same toy model:
# SGLang's GPU MLA kernels take these and refuse the toy widths above (benchmarks/gpu/targets_gpu.py).
DEEPSEEK_MLA_WIDTHS: dict[str, int] = {
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
}

# Kimi's special tokens, by their offset from the base vocabulary (Kimi-K2's tokenizer_config.json:
# 163584 + offset): <think> is 163606 there.
KIMI_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    22: "<think>",
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}
# The K2.5-style chat template written for aerie's tests (turns as <|im_role|>role<|im_middle|>...<|im_end|>,
# finished assistant turns with an empty <think></think>, the generation prompt opening <think>).
KIMI_TEMPLATE = Path(__file__).resolve().parent / "fixtures" / "chat_templates" / "kimi_k25.jinja"
# The byte-pair merges are learned from this text (and the pipeline prompts tokenize to a few hundred
# ids, not one per byte).
_BPE_TEXT = (
    "The quick brown fox jumps over the lazy dog. What is the capital of France? The capital of France "
    "is Paris. Please write a short story about a robot who learns to paint. Once upon a time, there "
    "was a small robot that lived in a quiet town. Explain how photosynthesis works in plants and why "
    "it matters for life on the planet. Count from one to ten: one, two, three, four, five, six, seven, "
    "eight, nine, ten. Write a Python function that returns the sum of a list of numbers. def add(a, b): "
    "return a + b. Thank you! You are a helpful assistant. Let me think about this step by step. "
)
_MERGES = 400


def tiny_config(arch: str, vocab_size: int, mla: dict[str, int] | None = None) -> Any:
    """The transformers config of the tiny `arch` target; `mla` replaces MLA head widths."""
    import transformers

    common = dict(_COMMON, vocab_size=vocab_size, max_position_embeddings=4096)
    if arch == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
        return transformers.LlamaConfig(**common, num_key_value_heads=2, rope_parameters=rope)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, num_key_value_heads=2, head_dim=32)
    if arch == "qwen3_moe":
        # head_dim is not in Qwen3MoeConfig's signature; its attention reads it from the config.
        return transformers.Qwen3MoeConfig(
            **dict(common, head_dim=32),
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
        )
    if arch == "deepseek_v3":
        # DeepSeek-V3's routing (8 groups of experts there, 2 here) and its YaRN x40 on theta 10000.
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
        common["max_position_embeddings"] = 163840
        return transformers.DeepseekV3Config(
            **common,
            **{**_MLA, **(mla or {})},
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            rope_parameters=rope,
        )
    if arch == "kimi":
        # Kimi-K2.5's text backbone: one expert group, YaRN x64 on theta 50000 from 4096 positions.
        rope = {
            "rope_type": "yarn",
            "rope_theta": 50000.0,
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
        common["max_position_embeddings"] = 262144
        return transformers.DeepseekV3Config(
            **common,
            **{**_MLA, **(mla or {})},
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.827,
            rope_parameters=rope,
        )
    if arch == "gpt_oss":
        return transformers.GptOssConfig(
            **dict(common, intermediate_size=64),
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,  # shorter than the prompts: the sliding layers matter
            layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
        )
    raise ValueError(f"unknown tiny architecture {arch!r}; one of {ARCHITECTURES}")


def tiny_model(arch: str, vocab_size: int = 512, seed: int = SEED, mla: dict[str, int] | None = None) -> Any:
    """The tiny `arch` model, seeded random weights, float32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab_size, mla), dtype=torch.float32)
    _spread_router_bias(model)
    return model.eval()


def _spread_router_bias(model: Any) -> None:
    """DeepSeek's `noaux_tc` routing adds a bias that starts at zero; random values make it matter."""
    import torch

    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand_like(buf) * 0.1)


def build_target(arch: str, out: Path, smollm2_dir: str | Path, mla: dict[str, int] | None = None) -> Path:
    """Save the tiny `arch` target with its tokenizer and chat template under `out`; returns `out`.
    `mla` replaces an MLA target's head widths (`DEEPSEEK_MLA_WIDTHS`)."""
    out.mkdir(parents=True, exist_ok=True)
    if arch == "kimi":
        vocab_size, eos = write_kimi_tokenizer(out)
        generation = {"bos_token_id": vocab_size - 256, "eos_token_id": eos}
    else:
        src = Path(smollm2_dir)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(src / name, out / name)
        vocab_size = 49152
        generation = {
            k: v for k, v in json.loads((src / "generation_config.json").read_text()).items() if "token" in k
        }
    model = tiny_model(arch, vocab_size, mla=mla)
    for key, value in generation.items():
        setattr(model.config, key, value)
        setattr(model.generation_config, key, value)
    model.save_pretrained(out)
    return out


# -- the Kimi-shaped tokenizer ------------------------------------------------------------------------


def kimi_ranks() -> dict[bytes, int]:
    """256 byte tokens, then byte-pair merges learned from a fixed text (deterministic)."""
    words = collections.Counter(f" {w}".encode() for w in _BPE_TEXT.split())
    ranks = {bytes([b]): b for b in range(256)}
    pieces = {w: [bytes([b]) for b in w] for w in words}
    for _ in range(_MERGES):
        pairs: collections.Counter[tuple[bytes, bytes]] = collections.Counter()
        for w, parts in pieces.items():
            for a, b in zip(parts, parts[1:], strict=False):
                pairs[a, b] += words[w]
        if not pairs:
            break
        (a, b), count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if count < 2:
            break
        ranks[a + b] = len(ranks)
        for w, parts in pieces.items():
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            pieces[w] = merged
    return ranks


def write_kimi_tokenizer(out: Path) -> tuple[int, int]:
    """Kimi's tokenizer files as Kimi ships them (its own code, `tiktoken.model`, a tokenizer_config.json
    naming the class in `auto_map`, the chat template); returns (vocabulary size, <|im_end|> id)."""
    ranks = kimi_ranks()
    base = len(ranks)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
    shutil.copy(KIMI_DIR / "tokenization_kimi.py", out / "tokenization_kimi.py")
    added = {
        str(base + offset): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for offset, token in KIMI_SPECIALS.items()
    }
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": added,
        "additional_special_tokens": [KIMI_SPECIALS[o] for o in (2, 3, 4, 10, 17, 22, 23)],
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(KIMI_TEMPLATE, out / "chat_template.jinja")
    return base + 256, base + 2
