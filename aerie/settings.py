"""aerie's own settings, from the environment or `.env` (prefix `AERIE_`). Prefect reads its own.

The cache (`AERIE_CACHE_DIR`, default `~/.cache/aerie`: converted targets, plan profiles, extraction
work) is the one place aerie writes under HOME; `cache_path` makes its folders and turns a refusal
(an unwritable or missing HOME, a read-only mount) into a `CacheDirError` naming the folder and the
variable that moves it, instead of a bare PermissionError.
"""

from __future__ import annotations

import os
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


def cache_path(*parts: str, root: Path | None = None) -> Path:
    """`<cache dir>/<parts...>` (`root` instead of the settings' one when given), created and writable;
    `CacheDirError` naming it and AERIE_CACHE_DIR when it cannot be."""
    path = Path(root if root is not None else get_settings().cache_dir).expanduser().joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise cache_dir_error(path, exc) from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise cache_dir_error(path, PermissionError("not writable"))
    return path


def cache_dir_error(path: Path | str, exc: OSError) -> Exception:
    """The one message for a cache folder aerie cannot write."""
    from aerie.errors import CacheDirError

    why = exc.strerror or str(exc)
    return CacheDirError(
        f"cannot write aerie's cache at {path} ({why}): set AERIE_CACHE_DIR to a writable directory "
        f"(the cache is {get_settings().cache_dir}; its default is ~/.cache/aerie, under "
        f"HOME={os.environ.get('HOME', '(unset)')})"
    )


def in_cache(filename: str | os.PathLike[str] | None) -> bool:
    """Whether a path (an OSError's `filename`) lies in aerie's cache."""
    if not filename:
        return False
    root = Path(get_settings().cache_dir).expanduser().absolute()
    path = Path(os.fsdecode(filename)).expanduser().absolute()
    return path == root or root in path.parents
