"""The flows fetch a stage's plots into a temporary folder to publish them; a run killed (SIGKILL) while
it reports cannot remove that folder. It is named for its owner, as the stages' work folders are
(aerie.workdirs), so the next run's report removes it. No Prefect server: the publishing is recorded."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest

import flows.evaluate
from aerie.manifest import StageResult
from aerie.store import LocalStore
from aerie.workdirs import host_tag

OWNED = re.compile(rf"^aerie-report-{host_tag()}-{os.getpid()}-\d+-")


def test_a_report_folder_is_named_for_its_owner_and_a_dead_owners_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    dead = tmp / f"aerie-report-{host_tag()}-999999999-1-killed"  # no process has that pid
    dead.mkdir()
    store = LocalStore(tmp_path / "store")
    prefix = "r/evaluate/0123456789abcdef"
    store.put_bytes(f"{prefix}/report.md", b"# report")
    store.put_bytes(f"{prefix}/{flows.evaluate.ACCEPTANCE_PNG}", b"png")
    published: list[Path] = []
    monkeypatch.setattr(flows.evaluate, "create_markdown_artifact", lambda *a, **k: None)
    monkeypatch.setattr(flows.evaluate, "image_artifact", lambda path, **k: published.append(Path(path)))
    result = StageResult(
        stage="evaluate",
        key="0123456789abcdef",
        prefix=prefix,
        manifest_uri="-",
        manifest_sha256="-",
        cache_hit=False,
        seconds=0.0,
    )
    flows.evaluate.report(result, store)
    [image] = published
    assert image.parent.parent == tmp and OWNED.match(image.parent.name), image
    assert not dead.exists()
    assert list(tmp.iterdir()) == []  # its own folder removed at the end
