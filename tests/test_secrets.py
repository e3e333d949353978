"""Secrets a run needs are checked before any stage starts, by name, never by value."""

from __future__ import annotations

import pytest

from aerie.cli import main
from aerie.pipeline import missing_secrets
from aerie.presets import load_config
from aerie.store import LocalStore

OPENROUTER = ["generate.datasets.0.num_samples=2"]


@pytest.fixture
def no_env_files(tmp_path, monkeypatch):
    """No key in the environment, no .env, no AWS files or instance metadata."""
    monkeypatch.chdir(tmp_path)
    for name in ("OPENROUTER_API_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return tmp_path


def test_an_openrouter_run_without_its_key_is_refused_before_any_stage(no_env_files, capsys):
    store = no_env_files / "store"
    code = main(["run", "kimi-k2.5-8gpu", "--no-prefect", f"store.uri={store}", *OPENROUTER])
    err = capsys.readouterr().err
    assert code == 2
    assert "OPENROUTER_API_KEY is not set: generation through https://openrouter.ai/api/v1 needs it" in err
    assert not store.exists() or not any(store.rglob("manifest.json"))  # no stage ran


def test_a_set_key_is_enough_and_is_never_echoed(no_env_files, monkeypatch):
    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-or-secret-value")
    cfg = load_config("kimi-k2.5-8gpu", [f"store.uri={no_env_files / 'store'}", *OPENROUTER])
    assert missing_secrets(cfg, LocalStore(no_env_files / "store")) == []
    (no_env_files / ".env").write_text("")
    monkeypatch.delenv("OPENROUTER_API_KEY")
    problems = missing_secrets(cfg, LocalStore(no_env_files / "store"))
    assert len(problems) == 1 and "sk-or-secret-value" not in problems[0]


def test_a_key_in_dotenv_counts(no_env_files):
    (no_env_files / ".env").write_text("OPENROUTER_API_KEY=sk-or-from-dotenv\n")
    cfg = load_config("kimi-k2.5-8gpu", [f"store.uri={no_env_files / 'store'}", *OPENROUTER])
    assert missing_secrets(cfg, LocalStore(no_env_files / "store")) == []


def test_a_local_endpoint_needs_no_key_and_an_s3_store_needs_credentials(no_env_files):
    cfg = load_config(
        "smollm2-local", ["generate.endpoint.base_url=http://127.0.0.1:9/v1", "store.uri=s3://bucket/p"]
    )
    [problem] = missing_secrets(cfg, LocalStore(no_env_files / "store"))
    assert problem.startswith("no AWS credentials for the store s3://bucket/p")


def test_every_missing_secret_is_named_at_once(no_env_files, capsys):
    """Neither AWS credentials for an S3 store nor the endpoint's key: one error names both (the store,
    which cannot be read without its credentials, is not asked whether generation is still pending)."""
    code = main(["run", "kimi-k2.5-8gpu", "--no-prefect", "store.uri=s3://bucket/p", *OPENROUTER])
    err = capsys.readouterr().err
    assert code == 2
    assert "2 secrets this run needs are missing" in err
    assert "no AWS credentials for the store s3://bucket/p" in err
    assert "OPENROUTER_API_KEY is not set: generation through https://openrouter.ai/api/v1" in err
    assert "cannot download" not in err  # the store was never read
