"""aerie's own settings, from the environment or `.env` (prefix `AERIE_`). Prefect reads its own."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Machine-level settings: caches, secrets and endpoints that differ per host, not per run."""

    model_config = SettingsConfigDict(env_prefix="AERIE_", env_file=".env", extra="ignore")

    cache_dir: Path = Field(
        Path.home() / ".cache" / "aerie", description="Converted targets and other caches."
    )
    webhook_url: SecretStr | None = Field(None, description="Slack-compatible webhook notified on failure.")
    prefect_ui_url: str | None = Field(
        None, description="Base URL of the Prefect UI, for links in notifications."
    )


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
