"""A tiktoken tokenizer shaped like the one Kimi-K2/K2.5 ship as their own code (`tokenization_kimi.py`,
loaded with `trust_remote_code`): a slow `PreTrainedTokenizer` over a `tiktoken.Encoding` read from
`tiktoken.model` (one `base64(token) rank` a line), with Kimi's special tokens numbered after the base
vocabulary and every other slot up to 256 a `<|reserved_token_i|>`. Written for aerie's tests: its
vocabulary is a small byte-pair one, not Kimi's.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import tiktoken
from transformers import PreTrainedTokenizer

# Kimi's pre-tokenizer splits Han characters apart from other letters; this one keeps that shape.
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_SPECIAL = 256


def load_ranks(path: str | os.PathLike[str]) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        bos_token: str = "[BOS]",
        eos_token: str = "[EOS]",
        unk_token: str = "[UNK]",
        pad_token: str = "[PAD]",
        additional_special_tokens: list[str] | None = None,
        added_tokens_decoder: dict[Any, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        ranks = load_ranks(vocab_file)
        base = len(ranks)
        named = {}
        for key, value in (added_tokens_decoder or {}).items():
            content = value["content"] if isinstance(value, dict) else str(value)
            named[int(key)] = content
        self.special_tokens = {
            named.get(i, f"<|reserved_token_{i - base}|>"): i for i in range(base, base + NUM_SPECIAL)
        }
        self.model = tiktoken.Encoding(
            name=Path(vocab_file).name,
            pat_str=PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.decoder = {rank: token for token, rank in ranks.items()}
        self.decoder.update({i: t.encode() for t, i in self.special_tokens.items()})
        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            additional_special_tokens=additional_special_tokens,
            added_tokens_decoder=added_tokens_decoder,
            **kwargs,
        )

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return {self._convert_id_to_token(i): i for i in range(self.vocab_size)}

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        # Tokens are the bytes of each piece, latin-1 mapped so that any byte sequence is a str.
        return [self.decoder[i].decode("latin-1") for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        if token in self.special_tokens:
            return self.special_tokens[token]
        return self.model.encode_single_token(token.encode("latin-1"))

    def _convert_id_to_token(self, index: int) -> str:
        data = self.decoder[index]
        return data.decode() if index in self.special_tokens.values() else data.decode("latin-1")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = b"".join(t.encode() if t in self.special_tokens else t.encode("latin-1") for t in tokens)
        return data.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        out = Path(save_directory) / ((filename_prefix + "-" if filename_prefix else "") + "tiktoken.model")
        lines = [
            f"{base64.b64encode(t).decode()} {r}"
            for t, r in sorted(self.model._mergeable_ranks.items(), key=lambda x: x[1])
        ]
        out.write_text("\n".join(lines) + "\n")
        return (str(out),)
