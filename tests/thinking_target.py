"""A tiny thinking target that really thinks: a Qwen3-architecture model whose weights make its greedy
output a fixed chain of tokens, so a test knows what a real server generating with it must return.

Its layers write nothing into the residual stream (every attention output and MLP down projection is
zero), so the logits depend on the current token only: the model is a lookup table from one token to
the next. The tokens of the chains get orthonormal embeddings and the lm_head row of each token's
successor is its predecessor's embedding, so greedy decoding walks the chain:

    after the generation prompt "<|im_start|>assistant\\n":   <think>Let me think</think>Hi<|im_end|>
    after "...<think>\\n\\n</think>\\n\\n" (enable_thinking=false):   Hi<|im_end|>

The tokenizer is the embedded SmolLM2's with `<think>` and `</think>` added as tokens that are not
special, as Qwen3's tokenizer has them (a decode that skips special tokens keeps them, as SGLang's
reasoning parser needs), and the target's own chat template is SmolLM2's (no think block):
the Qwen3 template is given as `corpus.chat_template`, the way a user supplies a corrected one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
QWEN3_TEMPLATE = TEMPLATES / "qwen3.jinja"
THINK_TAGS = ["<think>", "</think>"]
REASONING = "Let me think"
ANSWER = "Hi"
HIDDEN = 64


def _last_token(tokenizer: Any, template: str, **kwargs: Any) -> int:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Q"}],
        add_generation_prompt=True,
        tokenize=False,
        chat_template=template,
        **kwargs,
    )
    return int(tokenizer(prompt, add_special_tokens=False).input_ids[-1])


def chains(tokenizer: Any, template: str) -> list[list[int]]:
    """The token chains the model walks (each from a generation prompt's last token to the end of turn)."""

    def ids(text: str) -> list[int]:
        return [int(t) for t in tokenizer(text, add_special_tokens=False).input_ids]

    think = ids("<think>") + ids(REASONING) + ids("</think>") + ids(ANSWER) + ids("<|im_end|>")
    plain = ids(ANSWER) + ids("<|im_end|>")
    return [
        [_last_token(tokenizer, template), *think],
        [_last_token(tokenizer, template, enable_thinking=False), *plain],
    ]


def build_thinking_target(out: Path, smollm2: Any) -> Path:
    """Save the target under `out`; returns `out`."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = smollm2.load_tokenizer()
    tokenizer.add_tokens(THINK_TAGS)
    tokenizer.save_pretrained(out)
    shutil.copy(Path(smollm2.path) / "chat_template.jinja", out / "chat_template.jinja")
    paths = chains(tokenizer, QWEN3_TEMPLATE.read_text())
    links = {(a, b) for path in paths for a, b in zip(path, path[1:], strict=False)}
    heads = [a for a, _ in links]
    if len(set(heads)) != len(heads):
        raise AssertionError(f"a token has two successors in the chains {paths}: no lookup table")

    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=8,  # EAGLE-3 captures three distinct layers (2, 4, 5)
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    generation = json.loads((Path(smollm2.path) / "generation_config.json").read_text())
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tokens = sorted({t for path in paths for t in path})
    basis = torch.linalg.qr(torch.randn(HIDDEN, HIDDEN)).Q.T[: len(tokens)]  # orthonormal rows
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.get_input_embeddings().weight
        embed.normal_(std=0.02)
        head = model.get_output_embeddings().weight
        head.zero_()
        row = {t: i for i, t in enumerate(tokens)}
        for t in tokens:
            embed[t] = basis[row[t]]
        for a, b in links:
            head[b] += 4.0 * basis[row[a]]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in generation:
            setattr(model.config, key, generation[key])
            setattr(model.generation_config, key, generation[key])
    model.save_pretrained(out)
    return out
