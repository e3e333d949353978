"""Generation against the embedded default's endpoint: the reference server (a real process serving
SmolLM2-135M on CPU) answers `/v1/chat/completions`, and the regenerated turns land in the Parquet."""

from __future__ import annotations

from pathlib import Path

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
