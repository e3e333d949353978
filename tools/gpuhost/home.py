"""The host-side home directory every host subcommand works in."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.gpuhost.files import read_json

DEFAULT_HOME = "/tmp/aerie-host"


@dataclass
class Home:
    """The host-side directory every subcommand works in (outside the repository, so the copies of the
    working tree each command gets do not matter)."""

    root: Path

    @property
    def staged(self) -> Path:
        return self.root / "staged"

    @property
    def parts(self) -> Path:
        return self.root / ".parts"

    @property
    def site(self) -> Path:
        return self.root / "site"

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def index_path(self) -> Path:
        return self.root / "index.json"

    @property
    def created_path(self) -> Path:
        """Written at the first unpack: files newer than it were made on this host."""
        return self.root / ".created"

    @property
    def verified_path(self) -> Path:
        return self.root / ".verified.json"

    def index(self) -> dict[str, Any]:
        return dict(read_json(self.index_path, "the staging index (unpack a bundle first)"))

    def verified(self) -> dict[str, str]:
        """path under HOME -> sha256 of files already checked (so 100 MB is not re-hashed every call)."""
        if not self.verified_path.is_file():
            return {}
        return dict(read_json(self.verified_path, "the list of verified files"))
