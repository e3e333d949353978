"""Endpoint URLs are checked at config load (scheme, host), and an API key is never sent over plain
http:// to another machine unless `generate.endpoint.allow_insecure` says so: refused before any
request, naming the endpoint and the way out."""

from __future__ import annotations

from pathlib import Path

import pytest

from aerie.config import apply_overrides
from aerie.conversation import Conversation, Message
from aerie.datasets import SourceSpec
from aerie.errors import ConfigError
from aerie.generate.config import DatasetSpec, EndpointConfig, GenerateConfig
from aerie.generate.work import generate_dataset, key_of, stage_name
from aerie.manifest import StageDir
from aerie.presets import load_config
from aerie.store import LocalStore

KEY_ENV = "AERIE_TEST_URL_KEY"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("htps://openrouter.ai/api/v1", "the scheme must be http or https, got 'htps'"),
        ("openrouter.ai/api/v1", "no scheme"),
        ("https:///v1", "no host"),
        ("http://host:port/v1", "Port could not be cast"),
    ],
)
def test_a_bad_url_fails_at_load(url: str, says: str) -> None:
    cfg = load_config("smollm2-local", [])
    with pytest.raises(ConfigError, match="generate.endpoint") as info:
        apply_overrides(cfg, [f"generate.endpoint.base_url={url}"])
    assert says in str(info.value)


def run_once(tmp_path: Path, url: str, **endpoint: object) -> None:
    cfg = GenerateConfig(endpoint=EndpointConfig(base_url=url, api_key_env=KEY_ENV, **endpoint))
    spec = DatasetSpec(name="toy", source=SourceSpec(kind="jsonl", path="unused.jsonl"))
    conv = Conversation(id="c0", source="toy", messages=(Message(role="user", content="hi"),))
    stage_dir = StageDir(LocalStore(tmp_path / "store"), "r", stage_name(spec), key_of(cfg, spec))
    generate_dataset([conv], cfg, spec, stage_dir=stage_dir, base_url=url)


def test_a_key_is_never_sent_over_plain_http_to_another_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-url-test-secret")
    # 192.0.2.1 is TEST-NET-1: nothing answers there, and the refusal comes before any request.
    with pytest.raises(
        ConfigError, match=r"http://192.0.2.1/v1 is plain http:// .*allow_insecure=true"
    ) as info:
        run_once(tmp_path, "http://192.0.2.1/v1")
    assert "sk-url-test-secret" not in str(info.value)
    assert not (tmp_path / "store" / "r").exists() or not list((tmp_path / "store" / "r").rglob("part-*"))


def test_allow_insecure_lets_it_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-url-test-secret")
    with pytest.raises(Exception) as info:  # it goes on to ask the endpoint, which does not answer
        run_once(tmp_path, "http://192.0.2.1/v1", allow_insecure=True, connect_timeout_s=0.2, max_retries=0)
    assert not isinstance(info.value, ConfigError)
