from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aerie.errors import TargetError
from aerie.targets import TargetConfig, resolve_target


def test_embedded_target_facts(smollm2):
    assert (smollm2.geometry.num_layers, smollm2.geometry.hidden_size, smollm2.geometry.vocab_size) == (
        30,
        576,
        49152,
    )
    assert smollm2.aux_layers_input == [2, 15, 27]
    assert smollm2.aux_layers_output == [1, 14, 26]
    assert smollm2.eos_token_ids == [2]
    assert len(smollm2.revision) == 64


def test_embedded_target_answers_paris(smollm2):
    tok = smollm2.load_tokenizer()
    model = smollm2.load_model("cpu")
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids) :])


def test_unknown_target_is_a_clear_error(tmp_path):
    with pytest.raises(TargetError, match="neither an embedded target"):
        resolve_target("no-such-org/no-such-model", cache_dir=tmp_path)


PROBE_TOKENIZER = '''from transformers import PreTrainedTokenizerFast


class ProbeTokenizer(PreTrainedTokenizerFast):
    """Shipped with the model, as Kimi's tokenizer is: loads only with trust_remote_code."""
'''
PROBE_MODEL = '''from transformers import LlamaForCausalLM


class ProbeForCausalLM(LlamaForCausalLM):
    """Shipped with the model: loads only with trust_remote_code."""
'''


def remote_code_target(src: Path, dest: Path) -> Path:
    """The embedded target's files as a local directory whose tokenizer and model classes are the
    directory's own code (`auto_map`), the way Kimi-K2.5 ships them."""
    dest.mkdir()
    for name in ("generation_config.json", "tokenizer.json", "chat_template.jinja"):
        shutil.copy(src / name, dest / name)
    (dest / "model.safetensors").symlink_to(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_probe.ProbeForCausalLM"}
    (dest / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((src / "tokenizer_config.json").read_text())
    tok_config.update(
        tokenizer_class="ProbeTokenizer",
        auto_map={"AutoTokenizer": [None, "tokenization_probe.ProbeTokenizer"]},
    )
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (dest / "tokenization_probe.py").write_text(PROBE_TOKENIZER)
    (dest / "modeling_probe.py").write_text(PROBE_MODEL)
    return dest


def test_trust_remote_code_reaches_the_tokenizer_and_the_model(smollm2, tmp_path):
    path = remote_code_target(Path(smollm2.path), tmp_path / "remote")
    trusted = resolve_target(TargetConfig(name=str(path), trust_remote_code=True), cache_dir=tmp_path)
    assert trusted.trust_remote_code
    tok = trusted.load_tokenizer()
    assert type(tok).__name__ == "ProbeTokenizer"
    text = "Owls and tides: a short note on rivers."
    assert tok(text)["input_ids"] == smollm2.load_tokenizer()(text)["input_ids"]
    assert type(trusted.load_model("cpu")).__name__ == "ProbeForCausalLM"

    untrusted = resolve_target(str(path), cache_dir=tmp_path)
    assert not untrusted.trust_remote_code
    with pytest.raises(TargetError, match="set target.trust_remote_code"):
        untrusted.load_tokenizer()
    # A known architecture falls back to transformers' own class when the directory's code is not trusted.
    assert type(untrusted.load_model("cpu")).__name__ == "LlamaForCausalLM"


@pytest.mark.integration  # the load runs in a child process, where torch was never imported
def test_a_generic_fast_tokenizer_loads_without_torch_and_tokenizes_as_autotokenizer(smollm2):
    """A tokenizer.json named TokenizersBackend loads as that class directly, in a process that never
    imports torch (AutoTokenizer's look at the model config would), with the same ids and template."""
    probe = (
        "import json, sys; from aerie.targets import resolve_target; "
        "tok = resolve_target(sys.argv[1]).load_tokenizer(); "
        "print(json.dumps([type(tok).__name__, 'torch' in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, smollm2.path], capture_output=True, text=True, timeout=120, check=True
    )
    from transformers import AutoTokenizer

    direct, auto = smollm2.load_tokenizer(), AutoTokenizer.from_pretrained(smollm2.path)
    assert json.loads(done.stdout.splitlines()[-1]) == [type(auto).__name__, False]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Owls and tides: a short note on rivers, ünïcödé and 数字 123."},
        {"role": "assistant", "content": "Rivers run; owls hoot.\n\n- one\n- two"},
    ]
    text = auto.apply_chat_template(messages, tokenize=False)
    assert direct.apply_chat_template(messages, tokenize=False) == text
    assert direct(text)["input_ids"] == auto(text)["input_ids"]
    assert direct.all_special_ids == auto.all_special_ids and direct.eos_token_id == auto.eos_token_id
