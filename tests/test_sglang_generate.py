"""The generation stage against real SGLang on this CPU: the embedded default with server.backend=sglang
launches SGLang serving the target (aerie's generation endpoint, the process launcher, SGLang's own
environment) and the target regenerates its own answers to ShareGPT conversations through SGLang's
/v1/chat/completions; a generating process SIGKILLed mid-run loses nothing and duplicates nothing when
the dataset is generated again. One SGLang server for the module: each start costs a minute or two."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from aerie.datasets import SourceSpec, iter_conversations
from aerie.generate.config import DatasetSpec, GenerateConfig, SamplingParams
from aerie.generate.output import read_conversations
from aerie.generate.preflight import check_endpoint
from aerie.generate.server import generation_endpoint
from aerie.generate.work import run
from aerie.presets import load_config
from aerie.store import LocalStore
from tests.generate_support import check_resumed, journal_of, kill_mid_run
from tests.processes import free_port
from tests.sglang_support import cpu_config
from tests.stage_work import dataset_dir

pytestmark = pytest.mark.sglang

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory, smollm2) -> Iterator[str]:
    """SGLang serving the target, launched as the pipeline launches its generation endpoint."""
    cfg = load_config("smollm2-local", [])
    cfg.server = cpu_config(free_port(), tmp_path_factory.mktemp("shims") / "calls")
    with generation_endpoint(cfg, smollm2) as url:
        yield url


def generate_config(cfg_concurrency: int = 2) -> GenerateConfig:
    cfg = load_config("smollm2-local", []).generate
    return cfg.model_copy(
        update={
            "endpoint": cfg.endpoint.model_copy(
                update={"concurrency": cfg_concurrency, "read_timeout_s": 300}
            )
        }
    )


def sharegpt(name: str, n: int) -> DatasetSpec:
    """The embedded default's dataset, first turns only, greedy and short."""
    return DatasetSpec(
        name=name,
        source=SourceSpec(kind="sharegpt"),
        num_samples=n,
        max_turns=1,
        sampling=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
    )


def test_the_target_regenerates_its_answers_through_sglang(endpoint: str, tmp_path: Path) -> None:
    # run() checks the endpoint first: SGLang's /v1/models answers it (a note would mean it did not).
    assert check_endpoint(generate_config().endpoint, endpoint, None) is None
    spec = sharegpt("sg", 3)
    store = LocalStore(tmp_path / "store")
    cfg = generate_config()
    result = run(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=endpoint)
    frame = read_conversations(store.local_path(f"{result.prefix}/conversations.parquet"))
    originals = {c.id: c for c in iter_conversations(spec.source, spec.name, limit=3)}
    assert frame["id"].to_list() == list(originals)
    for row in frame.iter_rows(named=True):
        user, answer = row["messages"]
        original = originals[row["id"]].messages
        assert (user["role"], user["content"]) == ("user", original[0].content)
        assert answer["role"] == "assistant" and answer["content"].strip()
        assert answer["content"] != original[1].content  # the dataset's answer was replaced
        assert row["finish_reasons"] in (["stop"], ["length"])
        assert row["prompt_tokens"] > 0 and 0 < row["completion_tokens"] <= MAX_TOKENS
    assert result.figures["records"] == 3


def test_a_killed_generation_resumes_with_each_record_once(endpoint: str, tmp_path: Path) -> None:
    n = 6
    cfg, spec = generate_config(), sharegpt("killed", n)
    store_root = tmp_path / "store"
    done_before = kill_mid_run(cfg, spec, store_root, endpoint, at_lines=2, timeout_s=300)
    assert 2 <= len(done_before) < n
    store = LocalStore(store_root)
    result = run(cfg, spec, dataset_dir(store, "r", cfg, spec), base_url=endpoint)
    ids = [c.id for c in iter_conversations(spec.source, spec.name, limit=n)]
    check_resumed(store, result, journal_of(store_root, spec), ids, done_before)
