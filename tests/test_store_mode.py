"""A local store's objects get what the umask allows, as any file a program writes (a teammate or a
container user reads a shared store), or `store.mode`; an object's copy downloaded from the store (a
LocalStore, or S3 over a real moto server) is an ordinary file under the umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from aerie.errors import ConfigError
from aerie.presets import load_config
from aerie.store import LocalStore, StoreConfig, open_store
from aerie.store_api import current_umask

pytest_plugins = ("tests.s3_support",)


@pytest.fixture
def umask() -> Iterator[object]:
    """Set the process umask for one test, restored after."""
    saved = os.umask(0o022)

    def set_to(mask: int) -> None:
        os.umask(mask)

    yield set_to
    os.umask(saved)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def write_every_way(store: LocalStore, tmp_path: Path) -> list[Path]:
    """An object by each way in: put_file, put_bytes, adopt_file (renamed in), and their sidecars."""
    src = tmp_path / "src.bin"
    src.write_bytes(b"put")
    store.put_file("r/stage/k/put.bin", src)
    store.put_bytes("r/stage/k/bytes.json", b"{}")
    adopted = tmp_path / "adopted.bin"
    fd = os.open(adopted, os.O_WRONLY | os.O_CREAT, 0o600)  # a writer that made its file private
    os.write(fd, b"adopted")
    os.close(fd)
    store.adopt_file("r/stage/k/adopted.bin", adopted)
    objects = [
        Path(store.uri(k)) for k in ("r/stage/k/put.bin", "r/stage/k/bytes.json", "r/stage/k/adopted.bin")
    ]
    return objects + [p.with_name(f".{p.name}.sha256") for p in objects]


@pytest.mark.parametrize(("mask", "want"), [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_objects_follow_the_umask(mask: int, want: int, umask, tmp_path: Path) -> None:
    umask(mask)
    assert current_umask() == mask
    store = open_store(str(tmp_path / "store"))
    for path in write_every_way(store, tmp_path):
        assert mode(path) == want, path


def test_store_mode_sets_objects_and_their_directories(umask, tmp_path: Path) -> None:
    umask(0o077)  # a private umask: the setting decides, not it
    cfg = load_config("smollm2-local", [f"store.uri={tmp_path / 'store'}", "store.mode=0640"])
    store = open_store(cfg.store)
    assert isinstance(store, LocalStore)
    for path in write_every_way(store, tmp_path):
        assert mode(path) == 0o640, path
    for folder in (tmp_path / "store", tmp_path / "store/r", tmp_path / "store/r/stage/k"):
        assert mode(folder) == 0o750, folder


def test_store_mode_is_checked_at_load() -> None:
    with pytest.raises(ConfigError, match="store.mode"):
        load_config("smollm2-local", ["store.mode=0999"])
    with pytest.raises(ConfigError, match="who reads s3://bucket/p is the bucket's policy"):
        load_config("smollm2-local", ["store.uri=s3://bucket/p", "store.mode=0640"])
    assert StoreConfig(uri="/srv/aerie", mode="640").mode == "640"


def test_a_downloaded_copy_follows_the_umask(umask, tmp_path: Path) -> None:
    umask(0o027)
    store = LocalStore(tmp_path / "store", mode=0o600)
    store.put_bytes("r/a.bin", b"a")
    assert mode(store.get_file("r/a.bin", tmp_path / "out/a.bin")) == 0o640


@pytest.mark.integration
def test_an_s3_download_follows_the_umask(s3_config: StoreConfig, umask, tmp_path: Path) -> None:
    umask(0o022)
    store = open_store(s3_config)  # a real moto server over HTTP
    store.put_bytes("r/a.bin", b"a")
    assert mode(store.get_file("r/a.bin", tmp_path / "a.bin")) == 0o644


def test_a_leading_zero_mode_is_read_as_written(tmp_path: Path) -> None:
    """YAML 1.1 would read 0640 as the number 416: on the command line and in a file it stays '0640'."""
    from aerie.config import load_yaml

    assert load_config("smollm2-local", ["store.mode=0640"]).store.mode == "0640"
    path = tmp_path / "run.yaml"
    path.write_text(
        f"store:\n  uri: {tmp_path / 'store'}\n  mode: 0640\ngenerate:\n  datasets:\n"
        "    - name: chat\n      source: {kind: sharegpt}\n"
    )
    assert load_yaml(path).store.mode == "0640"
