from __future__ import annotations

import pytest
import torch

from aerie.errors import TargetError
from aerie.targets import resolve_target


def test_embedded_target_facts(smollm2):
    assert (smollm2.num_layers, smollm2.hidden_size, smollm2.vocab_size) == (30, 576, 49152)
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
