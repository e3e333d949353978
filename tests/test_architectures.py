"""Every target architecture through the inference engine's parts, in process, on tiny seeded targets
(tests/tiny_targets.py): the attention implementation the reference server picks, speculative decoding
of several prompts in one batch (lossless against transformers' own generate, the MLA cache's latent and
rope key compacted each with its own width, GPT-OSS's sliding window kept exact), and hidden-state
capture (packed where packed prefill covers the architecture, one sequence at a time where it refuses)
against a plain transformers forward."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from aerie.engine.server import packed
from aerie.engine.server.extraction import HiddenStateCapture
from aerie.engine.server.loader import attention_implementation
from aerie.engine.server.packed import make_pack, refusal
from aerie.engine.speculative.decoder import SpecDecoder, TargetCache, greedy_reference
from aerie.errors import ConfigError
from aerie.serving import ServerConfig
from aerie.serving.spec import spec_for
from aerie.sglang_plugin.compat import DEEPSEEK_V3_DEFAULTS, default_config_fields
from tests.tiny_targets import ARCHITECTURES, tiny_config, tiny_model

VOCAB = 512
MAX_NEW = 120  # with 8 slots a round and ~2.75 accepted, holes dominate after ~45 rounds
STEPS = 7
EOS = [VOCAB - 1]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request):
    return tiny_model(request.param, VOCAB)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB - 1) for _ in range(rng.randrange(18, 30))] for _ in range(n)]


def test_the_reference_server_picks_an_attention_the_architecture_supports():
    picked = {arch: attention_implementation(tiny_config(arch, VOCAB)) for arch in ARCHITECTURES}
    # GPT-OSS's attention sinks have no SDPA input in transformers: its eager attention runs them.
    assert picked == {arch: "eager" if arch == "gpt_oss" else "sdpa" for arch in ARCHITECTURES}


class OneRowRight:
    """Proposes the target's greedy continuation for one row of the batch a round (picked at random) and
    random tokens for the others: every row is mostly holes (rejected drafts) while the row in luck
    keeps the slots growing, so the cache is compacted again and again."""

    name = "one-row-right"
    needs_aux = False

    def __init__(self, full: dict[int, list[int]], seed: int = 0) -> None:
        self.full, self.rng = full, random.Random(seed)
        self.length: dict[int, int] = {}

    def add(self, seqs: Sequence[int], contexts: Sequence[list[int]], aux: Sequence[Tensor] | None) -> None:
        for seq, context in zip(seqs, contexts, strict=True):
            self.length[seq] = len(context)

    def propose(self, seqs: Sequence[int], k: int) -> list[list[int]]:
        lucky = self.rng.choice(list(seqs))
        return [
            self.full[s][self.length[s] : self.length[s] + k]
            if s == lucky
            else [self.rng.randrange(VOCAB - 1) for _ in range(k)]
            for s in seqs
        ]

    def advance(
        self, seqs: Sequence[int], new_tokens: Sequence[list[int]], aux: Sequence[Tensor] | None
    ) -> None:
        for seq, tokens in zip(seqs, new_tokens, strict=True):
            self.length[seq] += len(tokens)

    def remove(self, seqs: Sequence[int]) -> None:
        pass


@pytest.mark.slow  # 120 tokens of four prompts per architecture: 10-15 s each on a shared 2-core box
def test_batched_speculative_decoding_is_lossless_on_every_architecture(model, monkeypatch):
    """Four prompts in one batch, rows accepting differently: the output is transformers' own greedy
    continuation of each prompt alone, and the cache was compacted along the way (the MLA cache holds
    keys and values of different widths)."""
    prompts = _prompts(4)
    reference = [greedy_reference(model, p, MAX_NEW, EOS) for p in prompts]
    compactions: list[int] = []
    gather = TargetCache.maybe_compact

    def counted(self: TargetCache) -> None:
        before = self.slots
        gather(self)
        if self.slots < before:
            compactions.append(before - self.slots)

    monkeypatch.setattr(TargetCache, "maybe_compact", counted)
    full = {i: p + r for i, (p, r) in enumerate(zip(prompts, reference, strict=True))}
    decoder = SpecDecoder(model, OneRowRight(full), num_steps=STEPS, eos_token_ids=EOS)
    outs = decoder.generate(prompts, MAX_NEW)
    assert [o.output_ids for o in outs] == reference
    assert compactions, "the batch never compacted its cache: the test lost its point"


def test_mla_cache_compaction_keeps_what_a_cache_without_holes_computes():
    """DeepSeek-V3's cache: a latent-derived key of one width, a value of another. Rows with holes,
    compacted, then one more token: the logits a cache of only the live tokens gives."""
    model = tiny_model("deepseek_v3", VOCAB)
    prompts = _prompts(2, seed=1)
    width = 120  # enough dead slots that compaction is due (2 x longest + 64 < width)
    ids = torch.zeros(2, width, dtype=torch.long)
    valid = torch.zeros(2, width, dtype=torch.bool)
    positions = torch.zeros(2, width, dtype=torch.long)
    rng = random.Random(2)
    for row, prompt in enumerate(prompts):
        slots = sorted(rng.sample(range(width), len(prompt)))  # live slots scattered among dead ones
        ids[row, slots] = torch.tensor(prompt)
        valid[row, slots] = True
        positions[row, slots] = torch.arange(len(prompt))
    cache = TargetCache(model)
    with torch.no_grad():
        cache.forward(ids, valid, positions, None)
        layer: Any = cache.cache.layers[0]
        assert layer.keys.shape[-1] != layer.values.shape[-1]  # the point: two widths
        cache.maybe_compact()
        assert cache.slots == max(len(p) for p in prompts)
        nxt = torch.tensor([[7], [9]])
        pos = torch.tensor([[len(p)] for p in prompts])
        logits, _ = cache.forward(nxt, torch.ones(2, 1, dtype=torch.bool), pos, None)
        for row, prompt in enumerate(prompts):
            alone = model(torch.tensor([[*prompt, int(nxt[row])]])).logits[0, -1]
            torch.testing.assert_close(logits[row, -1], alone, atol=1e-4, rtol=1e-4)


def test_hidden_state_capture_matches_a_plain_forward(model):
    """Packed prefill where it covers the architecture, one sequence at a time where it refuses
    (GPT-OSS: sinks and sliding layers); either way the states HF's forward gives each sequence."""
    arch = model.config.model_type
    assert bool(refusal(model)) == (arch == "gpt_oss"), refusal(model)
    prompts = _prompts(3, seed=3)
    layers = [2, 4, 5]
    packed.register()
    capture = HiddenStateCapture(model, layers, "cpu")
    with torch.no_grad():
        aux, last = capture.forward_pack(make_pack(prompts, "cpu"))
        start = 0
        for prompt in prompts:
            out = model(torch.tensor([prompt]), output_hidden_states=True)
            want = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)
            end = start + len(prompt)
            torch.testing.assert_close(aux[start:end], want, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(last[start:end], out.hidden_states[-1][0], atol=1e-4, rtol=1e-4)
            start = end


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sglang_on_the_cpu_refuses_what_it_cannot_run_naming_its_limitation(arch: str, tmp_path) -> None:
    """Before any launch: an MLA target (DeepSeek-V3, Kimi) and GPT-OSS (attention sinks; SGLang's own
    argument check refuses its CPU engine's attention backend for the class) are refused for SGLang on
    the CPU with the ways that work; every other architecture gets its launch."""
    tiny_config(arch, VOCAB).save_pretrained(tmp_path)
    cfg = ServerConfig(backend="sglang", device="cpu", python=sys.executable)
    limitation = {
        "deepseek_v3": r"MLA attention .* SGLang 0.5.23 does not support on the CPU",
        "kimi": r"MLA attention .* SGLang 0.5.23 does not support on the CPU",
        "gpt_oss": r"has attention sinks, which SGLang 0.5.23 runs only with .* intel_amx",
    }
    if arch in limitation:
        with pytest.raises(ConfigError, match=limitation[arch]) as err:
            spec_for(cfg, model_path=str(tmp_path), mode="extract")
        assert "server.backend=reference" in str(err.value)
    else:
        assert spec_for(cfg, model_path=str(tmp_path), mode="extract").model_path == str(tmp_path)
    # On a GPU SGLang runs them all: no refusal there.
    spec_for(cfg.model_copy(update={"device": "cuda"}), model_path=str(tmp_path), mode="extract")
    if arch == "gpt_oss":  # a CPU with Intel AMX: the user names SGLang's CPU backend for sinks
        amx = cfg.model_copy(update={"extra_args": ["--attention-backend", "intel_amx"]})
        spec_for(amx, model_path=str(tmp_path), mode="extract")


def test_sglang_gets_the_deepseek_config_fields_transformers_does_not_write(tmp_path) -> None:
    """SGLang 0.5.23's DeepSeek class reads `moe_layer_freq`, `topk_method` and `scoring_func`; a config
    written by transformers has none. The plugin gives the config class DeepSeek-V3's values; a
    config.json that has a field keeps its value."""
    from transformers import AutoConfig

    tiny_config("deepseek_v3", VOCAB).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert not set(DEEPSEEK_V3_DEFAULTS) & set(written)
    default_config_fields()
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert {k: getattr(loaded, k) for k in DEEPSEEK_V3_DEFAULTS} == {
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
    }
    (tmp_path / "config.json").write_text(json.dumps({**written, "moe_layer_freq": 2}))
    assert AutoConfig.from_pretrained(tmp_path).moe_layer_freq == 2


def test_every_sglang_launch_of_a_transformers_deepseek_config_names_the_missing_fields(tmp_path) -> None:
    """Generation and serving launch SGLang without the extraction plugin, so the fields SGLang 0.5.23's
    DeepSeek class reads and transformers does not write go on the command line
    (`--json-model-override-args`), for a top-level config or a wrapper's `text_config`; a config that
    has them, or a launch with its own overrides, is left alone."""
    cfg = ServerConfig(backend="sglang", device="cuda", python=sys.executable)

    def overrides(mode: str, extra: Sequence[str] = ()) -> dict | None:
        argv = spec_for(cfg, model_path=str(tmp_path), mode=mode, extra_args=list(extra)).command
        flags = [i for i, a in enumerate(argv) if a == "--json-model-override-args"]
        assert len(flags) <= 1
        return json.loads(argv[flags[0] + 1]) if flags else None

    tiny_config("deepseek_v3", VOCAB).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    for mode in ("serve", "extract"):
        assert overrides(mode) == DEEPSEEK_V3_DEFAULTS
    assert overrides("serve", ["--json-model-override-args", "{}"]) == {}  # the user's own, once
    wrapper = {"model_type": "kimi_k25", "text_config": written}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    assert overrides("serve") == {"text_config": DEEPSEEK_V3_DEFAULTS}
    (tmp_path / "config.json").write_text(json.dumps({**written, **DEEPSEEK_V3_DEFAULTS}))
    assert overrides("serve") is None
    tiny_config("llama3", VOCAB).save_pretrained(tmp_path)
    assert overrides("serve") is None
