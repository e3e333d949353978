"""Generation against the embedded default's endpoint: the reference server (a real process serving
SmolLM2-135M on CPU) answers `/v1/chat/completions`, and the regenerated turns land in the Parquet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aerie.conversation import Conversation, Message
from aerie.datasets import SourceSpec
from aerie.generate.config import DatasetSpec, EndpointConfig, GenerateConfig, SamplingParams
from aerie.generate.output import read_conversations
from aerie.generate.work import generate_dataset, key_of, stage_name
from aerie.manifest import StageDir
from aerie.store import LocalStore
from tests.refserver_support import launch, wait_ready

pytestmark = pytest.mark.integration  # a reference server process


@pytest.mark.slow
def test_regenerates_with_the_reference_server(smollm2, tmp_path: Path):
    server = launch(str(smollm2.path), tmp_path, "--device", "cpu")
    try:
        wait_ready(server)
        url = f"{server.url}/v1"
        cfg = GenerateConfig(
            endpoint=EndpointConfig(base_url=url, concurrency=2, api_key_env="AERIE_TEST_NO_KEY")
        )
        spec = DatasetSpec(
            name="ref", source=SourceSpec(kind="jsonl", path="unused"), sampling=SamplingParams(max_tokens=8)
        )
        convs = [
            Conversation(
                id=f"r{i}",
                source="ref",
                messages=(
                    Message(role="user", content=f"What is {i}+{i}?"),
                    Message(role="assistant", content="stale"),
                    Message(role="user", content="And times two?"),
                ),
            )
            for i in range(2)
        ]
        store = LocalStore(tmp_path / "store")
        stage_dir = StageDir(store, "r", stage_name(spec), key_of(cfg, spec))
        result = generate_dataset(convs, cfg, spec, stage_dir=stage_dir, base_url=url)
    finally:
        server.stop()
    frame = read_conversations(store.local_path(f"{result.prefix}/conversations.parquet"))
    assert frame["id"].to_list() == ["r0", "r1"]
    for row in frame.iter_rows(named=True):
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["user", "assistant", "user", "assistant"]
        assert all(m["content"] and m["content"] != "stale" for m in row["messages"][1::2])
        assert set(row["finish_reasons"]) <= {"stop", "length"} and len(row["finish_reasons"]) == 2
        assert row["prompt_tokens"] > 0 and 0 < row["completion_tokens"] <= 16


def test_the_launched_generation_server_gets_the_endpoints_launch_args(smollm2) -> None:
    """The pipeline's own generation server takes `endpoint.launch_args` after `server.extra_args`
    (the later flag wins), and a set base_url refuses them: nothing would be launched."""
    import httpx

    from aerie.config import apply_overrides
    from aerie.errors import ConfigError
    from aerie.generate.preflight import check_endpoint
    from aerie.generate.server import generation_endpoint
    from aerie.presets import smollm2_local
    from tests.conftest import free_port

    cfg = apply_overrides(
        smollm2_local(),
        [
            f"server.port={free_port()}",
            "server.extra_args=[--max-running-requests,5]",
            "generate.endpoint.launch_args=[--max-running-requests,3]",
        ],
    )
    with generation_endpoint(cfg, smollm2) as url:
        info = httpx.get(url.removesuffix("/v1") + "/server_info", timeout=10).json()
        # The check before generation passes on the reference server (its /v1/models answers).
        assert check_endpoint(cfg.generate.endpoint, url, None) is None
    assert info["max_running_requests"] == 3
    with pytest.raises(ConfigError, match="base_url is set"):
        apply_overrides(
            smollm2_local(), ["generate.endpoint.base_url=http://x/v1", "generate.endpoint.launch_args=[-x]"]
        )


def _faulty_launch(smollm2: Any, tmp_path: Path, restarts: int) -> Any:
    """smollm2-local whose generation server fails every step after its warm-up (it reports itself
    unhealthy after 3 and the watch ends it), in its first launch only (AERIE_REFSERVER_FAULTS_ONCE)."""
    from aerie.config import apply_overrides
    from aerie.engine.server.faults import FAULTS_ENV, ONCE_ENV
    from aerie.presets import smollm2_local
    from tests.conftest import free_port

    cfg = apply_overrides(
        smollm2_local(),
        [
            f"server.port={free_port()}",
            "server.poll_interval_s=0.2",
            "generate.endpoint.launch_args=[--unhealthy-after,3]",
            "generate.endpoint.concurrency=2",
            "generate.endpoint.api_key_env=AERIE_TEST_NO_KEY",
            f"generate.max_server_restarts={restarts}",
        ],
    )
    env = {FAULTS_ENV: "step=9:*", ONCE_ENV: str(tmp_path / "faulted-once")}
    return cfg.model_copy(update={"server": cfg.server.model_copy(update={"env": env})})


def _conversations(n: int) -> list[Conversation]:
    return [
        Conversation(
            id=f"u{i}",
            source="ref",
            messages=(Message(role="user", content=f"Name a colour, number {i}."),),
        )
        for i in range(n)
    ]


def _one_dataset(cfg: Any) -> tuple[Any, DatasetSpec]:
    """Generation's settings with one dataset of short answers, and that dataset."""
    spec = DatasetSpec(
        name="ref", source=SourceSpec(kind="jsonl", path="unused"), sampling=SamplingParams(max_tokens=8)
    )
    return cfg.generate.model_copy(update={"datasets": [spec]}), spec


@pytest.mark.slow
def test_a_generation_server_that_turns_unhealthy_is_relaunched_and_generation_completes(
    smollm2: Any, tmp_path: Path
) -> None:
    """The launched server's steps fail until it declares itself unhealthy; its watch ends it; the
    requests failing on it wait for one relaunch on the same port and every conversation is generated,
    none lost, none counted as a failure."""
    from aerie.generate.server import generation_endpoint

    cfg = _faulty_launch(smollm2, tmp_path, restarts=2)
    gen, spec = _one_dataset(cfg)
    store = LocalStore(tmp_path / "store")
    with generation_endpoint(cfg, smollm2) as url:
        sd = StageDir(store, "r", stage_name(spec), key_of(gen, spec))
        result = generate_dataset(_conversations(6), gen, spec, stage_dir=sd, base_url=url)
    assert (tmp_path / "faulted-once").exists()  # the first launch did inject the faults
    manifest = sd.manifest()
    assert manifest is not None
    assert manifest["endpoint"]["server_restarts"] == 1
    assert manifest["counts"]["failed"] == 0
    frame = read_conversations(store.local_path(f"{result.prefix}/conversations.parquet"))
    assert sorted(frame["id"].to_list()) == [f"u{i}" for i in range(6)]


@pytest.mark.slow
def test_a_generation_server_that_dies_past_its_restarts_stops_the_dataset_naming_the_setting(
    smollm2: Any, tmp_path: Path
) -> None:
    from aerie.errors import EndpointError
    from aerie.generate.server import generation_endpoint

    cfg = _faulty_launch(smollm2, tmp_path, restarts=0)
    gen, spec = _one_dataset(cfg)
    store = LocalStore(tmp_path / "store")
    with generation_endpoint(cfg, smollm2) as url:
        sd = StageDir(store, "r", stage_name(spec), key_of(gen, spec))
        with pytest.raises(EndpointError, match=r"max_server_restarts=0 is used up.*\n.*unhealthy"):
            generate_dataset(_conversations(4), gen, spec, stage_dir=sd, base_url=url)
    assert sd.manifest() is None  # not finished: a re-run resumes from the journal
