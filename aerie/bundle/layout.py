"""The folder a bundle is installed into on the offline host, and what it holds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aerie.bundle.files import read_json


@dataclass
class InstallDir:
    """Where a bundle is unpacked and installed: `staged/` (its files, checked), `.parts/` (parts of split
    files waiting for the rest), `site/` (the installed wheels), `cache/` (AERIE_CACHE_DIR), `store/`
    (the artifact store a run may use), `env.sh` (the environment to source)."""

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
    def env_script(self) -> Path:
        return self.root / "env.sh"

    @property
    def created_path(self) -> Path:
        """Written at the first unpack: files newer than it were made on this host."""
        return self.root / ".created"

    @property
    def verified_path(self) -> Path:
        return self.root / ".verified.json"

    def index(self) -> dict[str, Any]:
        return dict(read_json(self.index_path, "the bundle's index (unpack a part of the bundle first)"))

    def verified(self) -> dict[str, str]:
        """path under the folder -> sha256 of files already checked (so large files are not re-hashed)."""
        if not self.verified_path.is_file():
            return {}
        return dict(read_json(self.verified_path, "the list of verified files"))
