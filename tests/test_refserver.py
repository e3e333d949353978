"""The reference server in extract mode, as a real process on 127.0.0.1 with the smollm2 target on CPU:
the dump contract checked numerically against a transformers forward in this process, packing
correctness, chat answers, batched == unbatched greedy generation, and SGLang's 400s."""

from __future__ import annotations

import concurrent.futures
import gzip
import json
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from aerie.fp8 import dequantize_fp8, quantize_fp8, scale_values
from tests.refserver_support import RefServer, launch, wait_ready

pytestmark = pytest.mark.integration  # a reference server process

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence to a curious five-year-old.",
]


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dumps")


@pytest.fixture(scope="module")
def server(smollm2, dump_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = launch(
        smollm2.path,
        tmp_path_factory.mktemp("logs"),
        "--mode",
        "extract",
        "--dump-dir",
        str(dump_dir),
        "--weight-version",
        "run-test-extract",
        "--device",
        "cpu",
    )
    try:
        wait_ready(srv)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def reference(smollm2):
    """The same target loaded by plain transformers in the test process (one thread: the host is shared
    and a tiny model's forward only loses time to a second, descheduled OpenMP thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield smollm2.load_model("cpu", "float32")
    finally:
        torch.set_num_threads(threads)


def _token_ids(smollm2, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, smollm2.geometry.vocab_size, (n,), generator=g).tolist()


def _generate(server: RefServer, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/generate", json=body, timeout=120)


def test_server_info_echoes_the_nonce_and_capture_layers(server: RefServer, smollm2) -> None:
    info = httpx.get(server.url + "/server_info").json()
    assert info["weight_version"] == "run-test-extract"
    assert info["mode"] == "extract" and info["device"] == "cpu" and info["dtype"] == "float32"
    assert info["aux_layers"] == smollm2.aux_layers_input == [2, 15, 27]
    assert info["model_path"] == smollm2.path
    assert "--weight-version run-test-extract" in info["launch_command"]
    assert httpx.get(server.url + "/get_server_info").json()["weight_version"] == "run-test-extract"


def test_prefill_dump_matches_a_transformers_forward(server: RefServer, reference, smollm2, dump_dir) -> None:
    ids = _token_ids(smollm2, 37, seed=1)
    reply = _generate(
        server,
        {
            "input_ids": ids,
            "rid": "sample-one",
            "sampling_params": {"max_new_tokens": 0},
            "return_hidden_states": True,
        },
    )
    assert reply.status_code == 200, reply.text
    meta = reply.json()["meta_info"]
    h = smollm2.geometry.hidden_size
    assert meta["dump"] == {
        "key": "sample-one.safetensors",
        "shapes": {"input_ids": [37], "aux_hidden": [37, 3 * h], "last_hidden": [37, h]},
        "dtype": "float32",
    }
    assert meta["completion_tokens"] == 0 and meta["prompt_tokens"] == 37 and meta["cached_tokens"] == 0
    assert len(reply.content) < 2000  # key, shapes and dtype only: no float lists over HTTP

    dump = load_file(dump_dir / "sample-one.safetensors")
    assert dump["input_ids"].dtype == torch.int32 and dump["input_ids"].tolist() == ids
    with torch.inference_mode():
        out = reference(torch.tensor([ids]), output_hidden_states=True)
        hs = out.hidden_states
        expected_aux = torch.cat([hs[2][0], hs[15][0], hs[27][0]], dim=-1)
        logits = reference.lm_head(dump["last_hidden"])
    assert (dump["aux_hidden"] - expected_aux).abs().max().item() < 1e-4
    # last_hidden is post-norm: lm_head of it gives the model's logits (and it equals HF's hidden_states[-1]).
    assert (logits - out.logits[0]).abs().max().item() < 1e-4
    assert (dump["last_hidden"] - hs[-1][0]).abs().max().item() < 1e-4
    # A ±1 layer error would not pass: neighbouring layers differ by far more than the tolerance.
    assert (dump["aux_hidden"][:, :h] - hs[1][0]).abs().max().item() > 1e-2
    with safe_open(str(dump_dir / "sample-one.safetensors"), "pt") as f:
        assert f.metadata()["aux_layers"] == "2,15,27" and f.metadata()["rid"] == "sample-one"


def _phases(server: RefServer) -> dict[str, float]:
    return httpx.get(server.url + "/server_info").json()["internal_states"][0]["extract_phases_s"]


def test_server_info_says_where_extraction_time_goes(server: RefServer, smollm2) -> None:
    before = _phases(server)
    body = {
        "input_ids": [_token_ids(smollm2, n, seed=40 + n) for n in (90, 12, 150)],
        "rid": ["phase-a", "phase-b", "phase-c"],
        "sampling_params": {"max_new_tokens": 0},
    }
    assert _generate(server, body).status_code == 200
    after = _phases(server)
    delta = {k: after[k] - before[k] for k in after}
    assert set(after) == {
        "wall", "idle", "write_slot_wait", "capture", "forward", "copy", "generate",
        "dump_copy_wait", "dump_write", "writers_busy", "request_parse", "reply_build",
    }  # fmt: skip
    assert all(v >= 0 for v in after.values()) and all(v >= 0 for v in delta.values())
    # The request's pack ran, was copied and written, and its HTTP handling was timed.
    assert delta["forward"] > 0 and delta["dump_write"] > 0 and delta["request_parse"] > 0
    assert delta["reply_build"] > 0 and delta["idle"] > 0
    # On the CPU the forward and the (no-op) copy happen inside the model thread's capture time.
    assert after["forward"] + after["copy"] <= after["capture"] + 1e-3
    assert after["dump_copy_wait"] == 0  # nothing in flight to wait for off CUDA
    # The model thread's phases cover its wall (all but bookkeeping), and never exceed it.
    thread = after["idle"] + after["write_slot_wait"] + after["capture"] + after["generate"]
    assert 0.8 * after["wall"] <= thread <= after["wall"] * 1.001 + 1e-3
    # The writers' busy wall is at most their summed work (plus the moments between the timers).
    assert after["writers_busy"] <= 1.05 * (after["dump_write"] + after["dump_copy_wait"]) + 0.05


def test_packed_batch_gives_the_same_dumps_as_one_at_a_time(server: RefServer, smollm2, dump_dir) -> None:
    lengths = [5, 64, 17, 130, 1]
    seqs = [_token_ids(smollm2, n, seed=10 + i) for i, n in enumerate(lengths)]
    for i, ids in enumerate(seqs):
        body = {"input_ids": ids, "rid": f"solo-{i}", "sampling_params": {"max_new_tokens": 0}}
        assert _generate(server, body).status_code == 200
    batch = {
        "input_ids": seqs,
        "rid": [f"pack-{i}" for i in range(len(seqs))],
        "sampling_params": {"max_new_tokens": 0},
        "return_hidden_states": True,
    }
    reply = _generate(server, batch)
    assert reply.status_code == 200, reply.text
    items = reply.json()
    assert [it["meta_info"]["dump"]["key"] for it in items] == [f"pack-{i}.safetensors" for i in range(5)]
    assert [it["meta_info"]["dump"]["shapes"]["aux_hidden"][0] for it in items] == lengths
    for i, ids in enumerate(seqs):
        solo = load_file(dump_dir / f"solo-{i}.safetensors")
        packed = load_file(dump_dir / f"pack-{i}.safetensors")
        assert packed["input_ids"].tolist() == ids
        # Packing changes only the floating-point summation order of the projections (GEMM shapes);
        # attention leaking across sequences or wrong positions would differ by O(1).
        for name in ("aux_hidden", "last_hidden"):
            torch.testing.assert_close(packed[name], solo[name], rtol=1e-4, atol=1e-3)
    assert not [p for p in dump_dir.iterdir() if p.name.startswith(".tmp-")]


@pytest.fixture(scope="module")
def fp8_server(smollm2, tmp_path_factory: pytest.TempPathFactory):
    """The same server with `--dump-dtype fp8`: states quantized on the device before the host copy;
    and it profiles its packs 1 and 2 (pack 0 is the warm-up) into the returned trace dir."""
    dumps = tmp_path_factory.mktemp("fp8-dumps")
    trace = tmp_path_factory.mktemp("fp8-trace") / "packs"
    srv = launch(
        smollm2.path,
        tmp_path_factory.mktemp("fp8-logs"),
        *("--mode", "extract", "--dump-dir", str(dumps), "--device", "cpu", "--dump-dtype", "fp8"),
        *("--trace-packs", "1:2", "--trace-dir", str(trace)),
    )
    try:
        wait_ready(srv)
        yield srv, dumps, trace
    finally:
        srv.stop()


def test_a_pack_trace_profiles_the_packs_asked_for(fp8_server, smollm2) -> None:
    fp8, _, trace = fp8_server
    for i in range(3):  # packs 1 and 2, whichever tests sent packs before
        body = {"input_ids": [_token_ids(smollm2, 30, seed=90 + i)], "rid": [f"t-{i}"]}
        assert _generate(fp8, {**body, "sampling_params": {"max_new_tokens": 0}}).status_code == 200
    deadline = time.monotonic() + 60  # the model thread writes it after the pack, the reply may come first
    while not (trace / "summary.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    summary = json.loads((trace / "summary.json").read_text())
    assert summary["packs"] == [1, 3] and summary["wall_us"] > 0
    assert summary["streams"] == {}  # a CPU server: no device stream to measure
    with gzip.open(trace / "trace.json.gz") as f:
        names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
    assert "aten::linear" in names  # the forward's ops are in it
    assert "aten::linear" in (trace / "ops.txt").read_text()


def test_fp8_dumps_are_the_model_dtype_dumps_quantized(
    server: RefServer, dump_dir, fp8_server, smollm2
) -> None:
    fp8, fp8_dumps, _ = fp8_server
    assert httpx.get(fp8.url + "/server_info").json()["dump_dtype"] == "fp8"
    assert httpx.get(server.url + "/server_info").json()["dump_dtype"] == "model"
    lengths = [40, 3, 75]
    body = {
        "input_ids": [_token_ids(smollm2, n, seed=60 + n) for n in lengths],
        "rid": [f"q-{n}" for n in lengths],
        "sampling_params": {"max_new_tokens": 0},
    }
    model_reply, fp8_reply = _generate(server, body), _generate(fp8, body)
    assert model_reply.status_code == fp8_reply.status_code == 200, fp8_reply.text
    h = smollm2.geometry.hidden_size
    for n, item in zip(lengths, fp8_reply.json(), strict=True):
        assert item["meta_info"]["dump"] == {
            "key": f"q-{n}.safetensors",
            "shapes": {
                "input_ids": [n],
                "aux_hidden": [n, 3 * h],
                "last_hidden": [n, h],
                "aux_scale": [n, 3],
                "last_scale": [n, 1],
            },
            "dtype": "float8_e4m3fn",
        }
        want = load_file(dump_dir / f"q-{n}.safetensors")
        got = load_file(fp8_dumps / f"q-{n}.safetensors")
        assert set(got) == {"input_ids", "aux_hidden", "aux_scale", "last_hidden", "last_scale"}
        assert got["input_ids"].dtype == torch.int32 and torch.equal(got["input_ids"], want["input_ids"])
        assert got["aux_hidden"].dtype == got["last_hidden"].dtype == torch.float8_e4m3fn
        assert got["aux_scale"].dtype == got["last_scale"].dtype == torch.uint8  # E8M0 exponents
        for name, groups in (("aux", 3), ("last", 1)):
            q, scale, ref = got[f"{name}_hidden"], got[f"{name}_scale"], want[f"{name}_hidden"]
            # The client's quantization of the float32 dump gives the same bits (same function, CPU).
            want_q, want_s = quantize_fp8(ref, groups)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_s)
            # Dequantized, each element is within e4m3's half step (2^-4 relative) of the model's, or
            # of a subnormal step of its group's scale near zero.
            back = dequantize_fp8(q, scale, torch.float32).reshape(n, groups, h)
            ref = ref.reshape(n, groups, h)
            bound = ref.abs() / 16 + scale_values(scale).reshape(n, groups, 1) / 2**9
            assert bool(((back - ref).abs() <= bound).all())
            assert float((back - ref).abs().max()) > 0  # fp8 does round: the comparison has teeth


def test_chat_answers_paris(server: RefServer, smollm2) -> None:
    reply = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "model": "anything",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32,
            "temperature": 0,
        },
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert "Paris" in data["choices"][0]["message"]["content"]
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["model"] == smollm2.path  # served name defaults to the model path, as in SGLang
    tok = smollm2.load_tokenizer()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    usage = data["usage"]
    assert usage["prompt_tokens"] == len(tok(prompt, add_special_tokens=False).input_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 < usage["completion_tokens"] <= 32


def _chat(server: RefServer, prompt: str) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_concurrent_chats_are_batched_and_equal_to_alone(server: RefServer) -> None:
    alone = [_chat(server, p) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _chat(server, p), PROMPTS))
    for a, b in zip(alone, together, strict=True):
        assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
        assert b["usage"] == a["usage"]
        assert b["choices"][0]["finish_reason"] == a["choices"][0]["finish_reason"]
    stats = httpx.get(server.url + "/server_info").json()["internal_states"][0]
    assert stats["peak_running"] >= 2  # the concurrent requests really shared decoding steps


def test_length_limit_and_stop_string(server: RefServer) -> None:
    body = {
        "messages": [{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
        "max_tokens": 5,
        "temperature": 0,
    }
    data = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert data["choices"][0]["finish_reason"] == "length" and data["usage"]["completion_tokens"] == 5
    reply = _generate(
        server,
        {"text": "1, 2, 3, 4,", "sampling_params": {"max_new_tokens": 30, "temperature": 0, "stop": ["7"]}},
    ).json()
    assert reply["meta_info"]["finish_reason"] == {"type": "stop", "matched": "7"}
    assert "7" not in reply["text"] and len(reply["output_ids"]) == reply["meta_info"]["completion_tokens"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input_ids": [1, 2, 3], "sampling_params": {"max_new_token": 4}}, "max_new_token"),
        ({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "n": 2}}, "sampling_params.n"),
        (
            {"input_ids": [1, 2], "rid": "../escape", "sampling_params": {"max_new_tokens": 0}},
            "cannot name a dump",
        ),
        ({"input_ids": [[1], [2]], "rid": ["x", "x"], "sampling_params": {"max_new_tokens": 0}}, "unique"),
        ({"input_ids": [1, 10**9], "sampling_params": {"max_new_tokens": 0}}, "outside the vocabulary"),
        ({"input_ids": [1, 2], "return_hidden_states": True}, "prefill-only"),
        ({"input_ids": [1], "text": "both"}, "exactly one"),
    ],
    ids=[
        "unknown-param",
        "unsupported-n",
        "unsafe-rid",
        "duplicate-rid",
        "bad-token",
        "hidden-with-decode",
        "both",
    ],
)
def test_bad_requests_get_400_naming_the_problem(server: RefServer, body: dict, message: str) -> None:
    reply = _generate(server, body)
    assert reply.status_code == 400
    assert reply.json()["object"] == "error" and message in reply.json()["message"]


def test_model_info_and_models(server: RefServer, smollm2) -> None:
    info = httpx.get(server.url + "/model_info").json()
    assert info["weight_version"] == "run-test-extract" and info["architectures"] == ["LlamaForCausalLM"]
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == smollm2.path and models["data"][0]["max_model_len"] == 8192
    assert json.dumps(httpx.get(server.url + "/get_model_info").json()) == json.dumps(info)


def test_seeded_sampling_is_reproducible(server: RefServer) -> None:
    body = {
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8,
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 7,
    }
    first, second = (
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120) for _ in range(2)
    )
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["message"] == second.json()["choices"][0]["message"]


def _events(server: RefServer, path: str, body: dict) -> list[dict | str]:
    """The server-sent events of a streamed request, in order ("[DONE]" as a string)."""
    events: list[dict | str] = []
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_generate_streams_a_chunk_per_step_and_ends_with_the_whole_reply(server: RefServer) -> None:
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    whole = _generate(server, body).json()
    events = _events(server, "/generate", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == list(range(1, len(counts) + 1))  # one new token per plain decoding step
    assert all(len(c["output_ids"]) == c["meta_info"]["completion_tokens"] for c in chunks)
    assert chunks[-1]["output_ids"] == whole["output_ids"] and chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    batch = _generate(server, {"input_ids": [[1, 2], [3, 4]], "stream": True})
    assert batch.status_code == 400 and "one input" in batch.json()["message"]


def test_chat_streams_openai_chunks_that_add_up_to_the_answer(server: RefServer) -> None:
    body = {
        "messages": [{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
        "max_tokens": 12,
        "temperature": 0,
        "stop": [", 5"],
    }
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()
    events = _events(server, "/v1/chat/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert len(chunks) > 3  # the text came in pieces, not at the end
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"] == whole["usage"]
