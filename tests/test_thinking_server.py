"""Generation with a thinking target on the reference server (a real process): the pipeline launches it
with the target's reasoning parser and the corpus's chat template, the server honours the request's
`chat_template_kwargs` and returns the think block in `reasoning_content` (whole and streamed), the
generation stage stores it in the reasoning field, and the merge supervises it.

The target is tests/thinking_target.py: a tiny Qwen3 model whose greedy output is known
(`<think>Let me think</think>Hi`), so what the server must return is known too."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from aerie.config import apply_overrides
from aerie.conversation import Conversation, Message
from aerie.corpus import iter_corpus
from aerie.corpus import work as corpus_work
from aerie.corpus.config import CorpusConfig
from aerie.datasets import SourceSpec
from aerie.generate.config import DatasetSpec, EndpointConfig, SamplingParams
from aerie.generate.output import read_conversations
from aerie.generate.server import generation_endpoint, reasoning_args
from aerie.generate.stage import generate_config
from aerie.generate.work import generate_dataset, key_of, stage_name
from aerie.manifest import StageDir, load_manifest
from aerie.presets import smollm2_local
from aerie.store import LocalStore
from aerie.targets import resolve_target
from tests.conftest import free_port
from tests.corpus_support import decoded_runs
from tests.stage_work import staged
from tests.thinking_target import ANSWER, QWEN3_TEMPLATE, REASONING, build_thinking_target

merge = staged("merge", corpus_work.run)

pytestmark = pytest.mark.integration  # a reference server process


@pytest.fixture(scope="module")
def thinker(smollm2, tmp_path_factory):
    return resolve_target(str(build_thinking_target(tmp_path_factory.mktemp("thinker") / "target", smollm2)))


def _chat(url: str, **body) -> dict:
    payload = {"messages": [{"role": "user", "content": "What?"}], "max_tokens": 16, "temperature": 0, **body}
    response = httpx.post(f"{url}/chat/completions", json=payload, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _streamed(url: str, **body) -> tuple[str, str]:
    """A streamed chat's reasoning and content, each its deltas joined."""
    payload = {"messages": [{"role": "user", "content": "What?"}], "max_tokens": 16, "stream": True, **body}
    reasoning = content = ""
    with httpx.stream("POST", f"{url}/chat/completions", json=payload, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    return reasoning, content


@pytest.mark.slow
def test_generation_stores_the_think_block_as_reasoning_and_merge_supervises_it(thinker, tmp_path: Path):
    cfg = apply_overrides(
        smollm2_local(), [f"server.port={free_port()}", f"corpus.chat_template={QWEN3_TEMPLATE}"]
    )
    args = reasoning_args(cfg, thinker)
    assert args == ["--chat-template", str(QWEN3_TEMPLATE.resolve()), "--reasoning-parser", "qwen3"]
    # The launched server renders with another template than the target's: that is in the key.
    gen = generate_config(cfg).model_copy(
        update={"endpoint": EndpointConfig(base_url="http://127.0.0.1:1/v1", api_key_env="AERIE_TEST_NO_KEY")}
    )
    spec = DatasetSpec(
        name="think", source=SourceSpec(kind="jsonl", path="unused"), sampling=SamplingParams(max_tokens=16)
    )
    assert gen.chat_template_sha256 is not None
    assert key_of(gen, spec) != key_of(gen.model_copy(update={"chat_template_sha256": None}), spec)
    store = LocalStore(tmp_path / "store")
    convs = [
        Conversation(id=f"c{i}", source="think", messages=(Message(role="user", content=f"Question {i}?"),))
        for i in range(2)
    ]
    with generation_endpoint(cfg, thinker) as url:
        whole = _chat(url)["choices"][0]
        assert whole["message"]["reasoning_content"] == REASONING
        assert whole["message"]["content"] == ANSWER and whole["finish_reason"] == "stop"
        # The request's template kwargs reach the template: no thinking, no reasoning.
        plain = _chat(url, chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
        assert (plain["reasoning_content"], plain["content"]) == (None, ANSWER)
        # Without the split the tags stay inline, as SGLang returns them.
        inline = _chat(url, separate_reasoning=False)["choices"][0]["message"]
        assert inline["content"] == f"<think>{REASONING}</think>{ANSWER}"
        assert _streamed(url) == (REASONING, ANSWER)
        assert _streamed(url, chat_template_kwargs={"enable_thinking": False}) == ("", ANSWER)
        stage_dir = StageDir(store, "r", stage_name(spec), key_of(gen, spec))
        generated = generate_dataset(convs, gen, spec, stage_dir=stage_dir, base_url=url)

    frame = read_conversations(store.local_path(f"{generated.prefix}/conversations.parquet"))
    answers = [row["messages"][1] for row in frame.iter_rows(named=True)]
    assert [(m["reasoning"], m["content"]) for m in answers] == [(REASONING, ANSWER)] * 2

    corpus = merge(
        CorpusConfig(eval_fraction=0.0, num_workers=1, chat_template=str(QWEN3_TEMPLATE)),
        store=store,
        run_name="r",
        target=thinker,
        inputs=[generated],
    )
    tok = thinker.load_tokenizer()
    supervised = [
        text
        for row in iter_corpus(store, corpus, "train")
        for text in decoded_runs(tok, row.input_ids, row.loss_mask)
    ]
    # The template's canonical form of the block (its newlines), reasoning first.
    assert supervised == [f"<think>\n{REASONING}\n</think>\n\n{ANSWER}<|im_end|>\n"] * 2
    reasoning = load_manifest(store, corpus.prefix)["reasoning"]
    assert reasoning["reasoning_tokens"] == reasoning["reasoning_tokens_supervised"] > 0
