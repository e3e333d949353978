"""aerie's cache (AERIE_CACHE_DIR, default ~/.cache/aerie) on a HOME it cannot write: the `aerie` command
stops with one line naming the folder and AERIE_CACHE_DIR, never a PermissionError traceback. Real
processes and real folders: a HOME under a regular file refuses every user (root included); a HOME
without write permission refuses any user but root, so that case runs only as another user."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aerie.errors import CacheDirError
from aerie.settings import cache_path

pytestmark = pytest.mark.integration  # the `aerie` command in a child process

ROOT = Path(__file__).resolve().parent.parent


def _aerie(home: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "AERIE_CACHE_DIR"}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "aerie.cli", *args],
        env=env,
        cwd=cwd,  # no .env of the checkout is read
        capture_output=True,
        text=True,
        timeout=300,
    )


def _read_only_home(tmp_path: Path) -> Path:
    if os.geteuid() == 0:
        pytest.skip("root writes into a folder without write permission: the other case covers root")
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o555)
    return home


def _home_under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file" / "home"


@pytest.mark.parametrize(
    "make_home", [_home_under_a_file, _read_only_home], ids=["under-a-file", "read-only"]
)
def test_an_unwritable_home_is_one_line_naming_the_cache_and_aerie_cache_dir(tmp_path: Path, make_home):
    home = make_home(tmp_path)
    done = _aerie(home, tmp_path, "plan", "smollm2-local")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("aerie: error:")]
    assert f"cannot write aerie's cache at {home}/.cache/aerie/targets" in line
    assert "set AERIE_CACHE_DIR to a writable directory" in line and f"HOME={home}" in line


def test_a_cache_folder_that_cannot_be_made_names_itself(tmp_path: Path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CacheDirError, match="AERIE_CACHE_DIR") as err:
        cache_path("extract", root=tmp_path / "a-file")
    assert f"{tmp_path}/a-file/extract" in str(err.value)
    assert cache_path("extract", root=tmp_path / "cache").is_dir()
