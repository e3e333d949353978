"""Tokenize ShareGPT conversations (SmolLM2 chat format) into the corpus the SGLang extraction and serving
jobs read: OUT/corpus.npz (token ids and lengths) and OUT/prompts.json (held-out first user turns).

    .venv/bin/python benchmarks/gpu/mkcorpus.py OUT [TOKENS]     (TOKENS: 6,000,000 by default)

Both go into S.tgz (benchmarks/gpu/README.md).
"""

import json
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from aerie.datasets import sharegpt_path
from aerie.targets import resolve_target

SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)
ROLE = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant"}
out_dir = Path(sys.argv[1])
want_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 6_000_000
max_len = 2048


def convs():
    text = sharegpt_path().read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj


tok = Tokenizer.from_file(str(Path(resolve_target("smollm2-135m-instruct").path) / "tokenizer.json"))
texts, prompts = [], []
n_conv = 0
for c in convs():
    turns = [(ROLE.get(t.get("from")), t.get("value", "")) for t in c.get("conversations", [])]
    turns = [(r, v) for r, v in turns if r and v.strip()]
    if len(turns) < 2 or turns[0][0] != "user":
        continue
    n_conv += 1
    if n_conv % 50 == 0 and len(prompts) < 256 and len(turns[0][1]) < 1500:
        # held out: never in the training/extraction corpus
        prompts.append(SYSTEM + "<|im_start|>user\n" + turns[0][1] + "<|im_end|>\n<|im_start|>assistant\n")
        continue
    texts.append(SYSTEM + "".join(f"<|im_start|>{r}\n{v}<|im_end|>\n" for r, v in turns))
    if len(texts) % 2000 == 0:
        enc = tok.encode_batch(texts[-2000:])
        total = sum(min(len(e.ids), max_len) for e in enc)
        # rough: stop when the estimate passes the wanted count
        if len(texts) * total / 2000 > want_tokens * 1.05:
            break
enc = tok.encode_batch(texts)
ids, lens, acc = [], [], 0
for e in enc:
    s = e.ids[:max_len]
    if len(s) < 16:
        continue
    ids.extend(s)
    lens.append(len(s))
    acc += len(s)
    if acc >= want_tokens:
        break
penc = tok.encode_batch(prompts)
out_dir.mkdir(parents=True, exist_ok=True)
np.savez(out_dir / "corpus.npz", ids=np.array(ids, dtype=np.uint16), lens=np.array(lens, dtype=np.int32))
(out_dir / "prompts.json").write_text(json.dumps({"prompts": prompts, "prompt_ids": [p.ids for p in penc]}))
print(
    "samples",
    len(lens),
    "tokens",
    acc,
    "prompts",
    len(prompts),
    "mean prompt len",
    sum(len(p.ids) for p in penc) / len(penc),
)
