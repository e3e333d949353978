"""The reference server in speculative mode (a real process with an exported, untrained EAGLE-3 drafter):
`/generate` and `/v1/chat/completions` return the target's greedy text and report SGLang's speculative
fields; sampled requests are still served (by the plain decoder)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from aerie.draft.export import export_drafter
from aerie.engine.speculative.decoder import greedy_reference
from aerie.evaluate.prompts import chat_prompt_ids
from tests.evaluate_support import random_drafter
from tests.refserver_support import launch, wait_ready

pytestmark = pytest.mark.integration  # a reference server process

MAX_NEW = 10


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory, smollm2):
    tmp = tmp_path_factory.mktemp("specsrv")
    drafter_dir = export_drafter(random_drafter(smollm2), tmp / "drafter", smollm2)
    server = launch(
        smollm2.path,
        tmp,
        "--device",
        "cpu",
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        str(drafter_dir),
        "--speculative-num-steps",
        "3",
    )
    try:
        wait_ready(server, timeout=300)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def target_model(smollm2):
    torch.set_num_threads(1)
    return smollm2.load_model("cpu", "float32")


def test_generate_is_greedy_and_reports_acceptance(spec_server, smollm2, target_model):
    tok = smollm2.load_tokenizer()
    texts = ["Count: 1, 2, 3, 4, 5,", "The capital of France is"]
    reply = httpx.post(
        spec_server.url + "/generate",
        json={"text": texts, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW}},
        timeout=300,
    )
    assert reply.status_code == 200, reply.text
    for text, item in zip(texts, reply.json(), strict=True):
        ids = list(tok(text).input_ids)
        expected = greedy_reference(target_model, ids, MAX_NEW, smollm2.eos_token_ids)
        assert item["output_ids"] == expected
        meta = item["meta_info"]
        assert meta["completion_tokens"] == len(expected)
        assert meta["spec_verify_ct"] >= 1
        assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])
        assert 0 <= meta["spec_accept_token_num"] <= meta["spec_draft_token_num"]


def test_chat_is_greedy_and_reports_acceptance(spec_server, smollm2, target_model):
    tok = smollm2.load_tokenizer()
    question = "Name three colours."
    reply = httpx.post(
        spec_server.url + "/v1/chat/completions",
        json={
            "model": "x",
            "messages": [{"role": "user", "content": question}],
            "max_tokens": MAX_NEW,
            "temperature": 0,
        },
        timeout=300,
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    expected = greedy_reference(target_model, chat_prompt_ids(tok, question), MAX_NEW, smollm2.eos_token_ids)
    assert body["choices"][0]["message"]["content"] == tok.decode(expected, skip_special_tokens=True)
    assert body["usage"]["completion_tokens"] == len(expected)
    assert body["meta_info"]["spec_verify_ct"] >= 1
    assert body["meta_info"]["spec_accept_length"] >= 1.0


def test_sampled_requests_are_served_by_the_plain_decoder(spec_server):
    reply = httpx.post(
        spec_server.url + "/generate",
        json={
            "text": "Once upon a time",
            "sampling_params": {"temperature": 0.8, "max_new_tokens": 5, "ignore_eos": True},
        },
        timeout=300,
    )
    assert reply.status_code == 200, reply.text
    meta = reply.json()["meta_info"]
    assert meta["completion_tokens"] == 5
    assert "spec_verify_ct" not in meta


def test_a_streamed_generation_counts_its_verify_steps_as_it_goes(spec_server, smollm2, target_model):
    """Each chunk is a verify round: the tokens it accepted (one or more) and spec_verify_ct so far; the
    last chunk is the whole greedy reply."""
    tok = smollm2.load_tokenizer()
    text = "Count: 1, 2, 3, 4, 5,"
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW}, "stream": True}
    chunks = []
    with httpx.stream("POST", spec_server.url + "/generate", json=body, timeout=300) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: ") :]))
    expected = greedy_reference(target_model, list(tok(text).input_ids), MAX_NEW, smollm2.eos_token_ids)
    assert chunks[-1]["output_ids"] == expected
    verify = [c["meta_info"]["spec_verify_ct"] for c in chunks]
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert verify == sorted(verify) and counts == sorted(set(counts))  # each chunk brought new tokens
    assert all(c["output_ids"] == expected[: c["meta_info"]["completion_tokens"]] for c in chunks)
