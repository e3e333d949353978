"""One conformance suite for every artifact store: LocalStore in a temp dir, S3Store against a real moto
server process (tests/s3_support.py). Faults are real too: a progress callback that raises mid-transfer,
bytes flipped in the stored object, an S3 endpoint on a closed port."""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import boto3
import pytest
from botocore.exceptions import ConnectionClosedError

from aerie.errors import IntegrityError, ObjectNotFoundError, StoreError
from aerie.manifest import StageDir
from aerie.s3store import S3Store
from aerie.store import ArtifactStore, LocalStore, StoreConfig, open_store
from tests.conftest import free_port

pytest_plugins = ("tests.s3_support",)

MULTIPART_FILE_MB = 12  # with 5 MiB parts (s3_support's config): three parts, so multipart really runs


class Interrupted(Exception):
    """Raised by a progress callback to cut a transfer short."""


# The S3 store runs against a moto server: those cases are integration tests.
@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.integration)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    if request.param == "local":
        return open_store(str(tmp_path / "artifacts"))
    return open_store(request.getfixturevalue("s3_config"))


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("src") / "big.bin"
    path.write_bytes(os.urandom(MULTIPART_FILE_MB << 20))
    return path


def corrupt(store: ArtifactStore, key: str) -> None:
    """Change the stored bytes behind the store's back, leaving its recorded sha256 as it was."""
    if isinstance(store, LocalStore):
        path = store.local_path(key)
        assert path is not None
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        return
    assert isinstance(store, S3Store)
    client = raw_client(store_config_of(store))
    full = full_key(store, key)
    old = client.get_object(Bucket=store.bucket, Key=full)
    data = bytearray(old["Body"].read())
    data[len(data) // 2] ^= 0xFF
    client.put_object(Bucket=store.bucket, Key=full, Body=bytes(data), Metadata=old["Metadata"])


def raw_client(cfg: StoreConfig) -> Any:
    """A plain boto3 client, apart from any store (tests.s3_support has one too, but importing from a
    module that is also a pytest plugin here would bypass pytest's assertion rewriting for it)."""
    return boto3.client("s3", endpoint_url=cfg.s3_endpoint_url, region_name=cfg.s3_region)


def store_config_of(store: S3Store) -> StoreConfig:
    meta = store.client.meta
    return StoreConfig(uri=store.root, s3_endpoint_url=meta.endpoint_url, s3_region=meta.region_name)


def full_key(store: S3Store, key: str) -> str:
    """The bucket key behind a store key."""
    return store.uri(key).removeprefix(f"s3://{store.bucket}/")


def leftovers(store: ArtifactStore) -> list[str]:
    """Everything the store holds, seen from below: every file under a LocalStore's root (temp files
    and sidecars included); every open multipart upload under an S3Store's prefix."""
    if isinstance(store, LocalStore):
        root = Path(store.root)
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert isinstance(store, S3Store)
    uploads = raw_client(store_config_of(store)).list_multipart_uploads(Bucket=store.bucket)
    prefix = full_key(store, "x")[:-1]
    return [u["Key"] for u in uploads.get("Uploads", []) if u["Key"].startswith(prefix)]


def test_bytes_round_trip(store: ArtifactStore) -> None:
    data = b'{"stage": "merge", "records": 17671}'
    info = store.put_bytes("run/merge/abc/manifest.json", data)
    assert info.key == "run/merge/abc/manifest.json"
    assert info.size == len(data)
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert info.uri == store.uri("run/merge/abc/manifest.json")
    assert store.get_bytes("run/merge/abc/manifest.json") == data
    with store.open("run/merge/abc/manifest.json") as f:
        assert f.read() == data
    assert store.exists("run/merge/abc/manifest.json")
    assert store.put_bytes("empty", b"").size == 0
    assert store.get_bytes("empty") == b""
    big = os.urandom(6 << 20)  # over the 5 MiB multipart threshold: bytes take the multipart path too
    assert store.put_bytes("run/big.bin", big).sha256 == hashlib.sha256(big).hexdigest()
    assert store.get_bytes("run/big.bin") == big
    assert (store.local_path("run/big.bin") is None) == isinstance(store, S3Store)


def test_file_round_trip_multipart(store: ArtifactStore, big_file: Path, tmp_path: Path) -> None:
    seen: list[float] = []
    info = store.put_file(
        "run/extract/k/shard-00000.safetensors", big_file, progress=lambda f, m: seen.append(f)
    )
    want = hashlib.sha256(big_file.read_bytes()).hexdigest()
    assert (info.size, info.sha256) == (big_file.stat().st_size, want)
    assert seen[-1] == 1.0 and seen == sorted(seen)

    seen.clear()
    dest = tmp_path / "down" / "shard.safetensors"
    assert (
        store.get_file("run/extract/k/shard-00000.safetensors", dest, progress=lambda f, m: seen.append(f))
        == dest
    )
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == want
    assert seen[-1] == 1.0
    assert os.listdir(dest.parent) == ["shard.safetensors"]  # no temp file left beside it

    if isinstance(store, S3Store):
        head = raw_client(store_config_of(store)).head_object(
            Bucket=store.bucket, Key=full_key(store, info.key)
        )
        assert head["Metadata"]["sha256"] == want  # x-amz-meta-sha256
        assert head["ETag"].strip('"').endswith("-3")  # a multipart ETag: md5-of-md5s, then the part count


def test_nested_keys_list_and_delete(store: ArtifactStore) -> None:
    keys = ["a/b/c.txt", "a/b/d.txt", "a/bc/x.txt", "a/e.txt", "f.txt"]
    for key in keys:
        store.put_bytes(key, key.encode())
    assert store.list() == sorted(keys)
    assert store.list("a/b") == ["a/b/c.txt", "a/b/d.txt"]  # a directory, so not a/bc
    assert store.list("a/b/") == ["a/b/c.txt", "a/b/d.txt"]
    assert store.list("a/b/c.txt") == ["a/b/c.txt"]
    assert store.list("nothing/here") == []

    store.delete("a/b/c.txt")
    assert not store.exists("a/b/c.txt")
    assert store.list("a/b") == ["a/b/d.txt"]
    store.delete("a/b/c.txt")  # deleting what is gone is not an error
    store.put_bytes("f.txt", b"overwritten")
    assert store.get_bytes("f.txt") == b"overwritten"


@pytest.mark.parametrize("key", ["", "/", "a//b", "../x", "a/../b", "a/./b", ".hidden", "a/.b.sha256"])
def test_invalid_keys_are_refused(store: ArtifactStore, key: str, tmp_path: Path) -> None:
    calls: list[Callable[[], Any]] = [
        lambda: store.put_bytes(key, b"x"),
        lambda: store.get_bytes(key),
        lambda: store.exists(key),
        lambda: store.uri(key),
    ]
    for call in calls:
        with pytest.raises(StoreError, match="invalid artifact key"):
            call()
    if key.strip("/"):
        with pytest.raises(StoreError, match="invalid artifact key"):
            store.list(key)
    assert store.list() == []


def test_missing_key(store: ArtifactStore, tmp_path: Path) -> None:
    assert not store.exists("run/nothing.json")
    with pytest.raises(ObjectNotFoundError, match="nothing.json"):
        store.get_bytes("run/nothing.json")
    with pytest.raises(FileNotFoundError):  # ObjectNotFoundError is also a FileNotFoundError
        store.open("run/nothing.json")
    with pytest.raises(ObjectNotFoundError):
        store.get_file("run/nothing.json", tmp_path / "d" / "nothing.json")
    assert not (tmp_path / "d" / "nothing.json").exists()


@contextmanager
def parts_after_the_first_held(store: ArtifactStore, release: threading.Event) -> Iterator[None]:
    """On S3, hold every UploadPart but the first at the wire until `release` is set, so a fault
    injected at ~40 % lands while the upload is certainly incomplete (on localhost 12 MB would
    otherwise be done before the caller's thread gets to report). A LocalStore copies in the caller's
    thread: nothing to hold."""
    if not isinstance(store, S3Store):
        yield
        return

    def hold(request: Any, **kwargs: Any) -> None:
        if parse_qs(urlsplit(request.url).query).get("partNumber") != ["1"]:
            release.wait(timeout=30)

    events = store.client.meta.events
    events.register("before-send.s3.UploadPart", hold)
    try:
        yield
    finally:
        release.set()
        events.unregister("before-send.s3.UploadPart", hold)


def assert_nothing_left(store: ArtifactStore, survivor: str, content: bytes) -> None:
    assert store.list() == [survivor]
    assert store.get_bytes(survivor) == content  # what was there before survives
    if isinstance(store, LocalStore):  # no temp file: only the object and its checksum sidecar
        assert leftovers(store) == ["run/.keep.bin.sha256", "run/keep.bin"]
    else:
        assert leftovers(store) == []  # no multipart upload left open


def test_upload_cancelled_by_progress_callback_leaves_nothing(store: ArtifactStore, big_file: Path) -> None:
    """Raising from `progress` (how a caller cancels; Ctrl-C takes the same path) aborts the upload."""
    store.put_bytes("run/keep.bin", b"version 1")
    for key in ("run/new.bin", "run/keep.bin"):  # a new object, and an overwrite
        release = threading.Event()

        def interrupt(fraction: float, message: str, release: threading.Event = release) -> None:
            if fraction >= 0.3:  # S3: part 1 of 3 is sent, the others are held
                release.set()
                raise Interrupted(message)

        with parts_after_the_first_held(store, release), pytest.raises(Interrupted):
            store.put_file(key, big_file, progress=interrupt)
    assert not store.exists("run/new.bin")
    assert_nothing_left(store, "run/keep.bin", b"version 1")


@pytest.mark.integration
def test_s3_connection_lost_mid_upload_leaves_nothing(s3_config: StoreConfig, big_file: Path) -> None:
    """Part 2 never gets through (the connection drops on every attempt): retries run out, the
    multipart upload is aborted, and the error says which object and what to check. The first time,
    s3transfer's own abort is dropped as well: the store's second abort must still close the upload."""
    s3_config = s3_config.model_copy(update={"s3_max_attempts": 2})  # fewer backoff sleeps
    store = S3Store(s3_config)
    store.put_bytes("run/keep.bin", b"version 1")
    part_2_tries: list[str] = []
    abort_tries: list[str] = []

    def drop_part_2(request: Any, **kwargs: Any) -> None:
        if parse_qs(urlsplit(request.url).query).get("partNumber") == ["2"]:
            part_2_tries.append(urlsplit(request.url).path.rsplit("/", 1)[1])
            raise ConnectionClosedError(endpoint_url=request.url)

    def drop_first_abort(request: Any, **kwargs: Any) -> None:
        abort_tries.append(urlsplit(request.url).path.rsplit("/", 1)[1])
        if len(abort_tries) <= s3_config.s3_max_attempts:  # every attempt of s3transfer's abort call
            raise ConnectionClosedError(endpoint_url=request.url)

    store.client.meta.events.register("before-send.s3.UploadPart", drop_part_2)
    store.client.meta.events.register("before-send.s3.AbortMultipartUpload", drop_first_abort)
    for key in ("run/new.bin", "run/keep.bin"):
        with pytest.raises(StoreError, match="cannot reach the S3 endpoint") as info:
            store.put_file(key, big_file)
        assert store.uri(key) in str(info.value)
    attempts = s3_config.s3_max_attempts
    assert part_2_tries == ["new.bin"] * attempts + ["keep.bin"] * attempts  # retried, then given up
    assert abort_tries[attempts:] == ["new.bin", "keep.bin", "keep.bin"]  # ours; s3transfer's, then ours
    assert not store.exists("run/new.bin")
    assert_nothing_left(store, "run/keep.bin", b"version 1")


def test_corrupted_object_is_detected(store: ArtifactStore, big_file: Path, tmp_path: Path) -> None:
    store.put_file("run/shard.bin", big_file)
    store.put_bytes("run/manifest.json", b'{"samples": 3}')
    corrupt(store, "run/shard.bin")
    corrupt(store, "run/manifest.json")

    dest = tmp_path / "down" / "shard.bin"
    with pytest.raises(IntegrityError, match="sha256"):
        store.get_file("run/shard.bin", dest)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []  # the temp download was removed too
    with pytest.raises(IntegrityError):
        store.get_bytes("run/manifest.json")
    with pytest.raises(IntegrityError):
        store.open("run/manifest.json")


def test_a_corrupt_local_object_names_the_stage_folder_to_delete(tmp_path: Path) -> None:
    """Deleting the object alone would leave its stage's manifest (the re-run would take the stage as
    done and the object would stay missing): the message names the stage's folder instead."""
    store = LocalStore(tmp_path / "store")
    store.put_bytes("run/stage/key/part/rows.bin", b"rows " * 100)
    store.put_bytes("run/stage/key/manifest.json", b"{}")
    path = store.local_path("run/stage/key/part/rows.bin")
    assert path is not None
    path.write_bytes(b"rowz " + path.read_bytes()[5:])
    folder = tmp_path / "store" / "run" / "stage" / "key"
    with pytest.raises(IntegrityError, match=f"delete {folder} \\(the stage that wrote it\\) and re-run"):
        store.get_bytes("run/stage/key/part/rows.bin")
    store.put_bytes("loose.bin", b"x")
    (tmp_path / "store" / "loose.bin").write_bytes(b"y")
    with pytest.raises(IntegrityError, match="delete it and re-run the stage that wrote it"):
        store.get_bytes("loose.bin")


def test_a_killed_writes_temp_file_is_swept_by_the_next_write(tmp_path: Path) -> None:
    """A SIGKILL mid-write leaves `.<name>.<random>.part` beside the object (no cleanup runs); the next
    write of that object removes it, and leaves alone a temp file being written now."""
    store = LocalStore(tmp_path / "store")
    store.put_bytes("d/README.md", b"first")
    folder = tmp_path / "store" / "d"
    stale, live = folder / ".README.md.k1ll3d.part", folder / ".README.md.n0w.part"
    stale.write_bytes(b"half")
    os.utime(stale, (1.0, 1.0))
    other = folder / ".weights.bin.k1ll3d.part"  # another object's: not this write's to sweep
    other.write_bytes(b"half")
    os.utime(other, (1.0, 1.0))
    live.write_bytes(b"under way")
    os.utime(live, (4e9, 4e9))  # written after this write began
    store.put_bytes("d/README.md", b"second")
    assert store.get_bytes("d/README.md") == b"second"
    assert not stale.exists() and live.exists() and other.exists()


def test_adopt_file_takes_the_file_over(store: ArtifactStore, big_file: Path, tmp_path: Path) -> None:
    src = tmp_path / "closed" / "shard-00000.safetensors"
    src.parent.mkdir()
    src.write_bytes(big_file.read_bytes())
    inode = src.stat().st_ino
    want = hashlib.sha256(big_file.read_bytes()).hexdigest()
    store.put_bytes("run/shard.bin", b"an older object under the key")

    info = store.adopt_file("run/shard.bin", src, sha256=want)
    assert (info.key, info.size, info.sha256) == ("run/shard.bin", big_file.stat().st_size, want)
    assert not src.exists() and list(src.parent.iterdir()) == []
    assert store.get_bytes("run/shard.bin") == big_file.read_bytes()
    if isinstance(store, LocalStore):
        local = store.local_path("run/shard.bin")
        assert local is not None and local.stat().st_ino == inode  # renamed, not copied
        assert leftovers(store) == ["run/.shard.bin.sha256", "run/shard.bin"]
    corrupt(store, "run/shard.bin")  # the digest was recorded: later reads still verify
    with pytest.raises(IntegrityError):
        store.get_bytes("run/shard.bin")

    store.put_bytes("run/keep.bin", b"version 1")
    src.write_bytes(b"changed after it was hashed")
    for key in ("run/new.bin", "run/keep.bin"):
        with pytest.raises(IntegrityError, match="was not stored") as err:
            store.adopt_file(key, src, sha256=want)
        assert str(src) in str(err.value)
        assert src.read_bytes() == b"changed after it was hashed"  # refused files stay with the caller
    assert not store.exists("run/new.bin")
    assert store.get_bytes("run/keep.bin") == b"version 1"

    with pytest.raises(StoreError, match="cannot read .*missing.bin"):
        store.adopt_file("run/missing.bin", tmp_path / "missing.bin")
    changed = hashlib.sha256(src.read_bytes()).hexdigest()
    assert store.adopt_file("run/unchecked.bin", src).sha256 == changed  # no digest given: none checked
    assert store.list("run") == ["run/keep.bin", "run/shard.bin", "run/unchecked.bin"]


def test_adopt_file_without_reread(store: ArtifactStore, tmp_path: Path) -> None:
    """`reread=False`: a LocalStore renames the file in with the writer's digest, not reading it (so a
    change after the writer hashed it goes unnoticed there, the trade `extract.reread_shards` states);
    an S3 upload reads the file anyway and still refuses one that does not match."""
    src = tmp_path / "shard.bin"
    src.write_bytes(b"changed after it was hashed")
    want = hashlib.sha256(b"the bytes the writer hashed").hexdigest()
    if isinstance(store, LocalStore):
        info = store.adopt_file("run/shard.bin", src, sha256=want, reread=False)
        assert info.sha256 == want and not src.exists()  # taken on trust, not read
        with pytest.raises(IntegrityError):  # reads of the object still verify against that digest
            store.get_bytes("run/shard.bin")
    else:
        with pytest.raises(IntegrityError):
            store.adopt_file("run/shard.bin", src, sha256=want, reread=False)
        assert src.exists() and not store.exists("run/shard.bin")
    good = tmp_path / "good.bin"
    good.write_bytes(b"the bytes the writer hashed")
    assert store.adopt_file("run/good.bin", good, sha256=want, reread=False).sha256 == want
    assert store.get_bytes("run/good.bin") == b"the bytes the writer hashed"


SHM = Path("/dev/shm")


@pytest.mark.skipif(
    not SHM.is_dir() or SHM.stat().st_dev == Path(__file__).stat().st_dev,
    reason="needs /dev/shm on a filesystem other than the checkout's",
)
def test_local_adopt_file_across_filesystems_copies_then_deletes(tmp_path: Path) -> None:
    """rename() fails with EXDEV across filesystems: the file is copied in, verified, then deleted."""
    store = LocalStore(tmp_path / "artifacts")
    data = os.urandom(3 << 20)
    with tempfile.TemporaryDirectory(dir=SHM) as shm:
        src = Path(shm) / "shard.bin"
        src.write_bytes(data)
        assert src.stat().st_dev != (tmp_path).stat().st_dev
        info = store.adopt_file("run/shard.bin", src, sha256=hashlib.sha256(data).hexdigest())
        assert not src.exists()
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert store.get_bytes("run/shard.bin") == data
    assert leftovers(store) == ["run/.shard.bin.sha256", "run/shard.bin"]  # no temp file left


def test_open_store_picks_the_backend(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    s3 = open_store("s3://bucket/some/prefix")
    assert isinstance(s3, S3Store)
    assert s3.uri("run/x.json") == "s3://bucket/some/prefix/run/x.json"
    assert open_store(StoreConfig(uri="s3://bucket")).uri("x") == "s3://bucket/x"
    with pytest.raises(StoreError, match="invalid store uri"):
        open_store("s3:///no-bucket")


# -- S3 only: what a LocalStore cannot get wrong ----------------------------------------------------


@pytest.mark.integration
def test_s3_dead_endpoint_is_a_clear_error(s3_server: StoreConfig, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    store = S3Store(
        s3_server.model_copy(
            update={"s3_endpoint_url": dead, "s3_max_attempts": 1, "s3_connect_timeout_s": 2}
        )
    )
    calls: list[Callable[[], Any]] = [
        lambda: store.exists("run/x.json"),
        lambda: store.put_bytes("run/x.json", b"{}"),
        lambda: store.get_file("run/x.json", tmp_path / "x.json"),
        lambda: store.list(),
    ]
    for call in calls:
        with pytest.raises(StoreError, match="cannot reach the S3 endpoint") as info:
            call()
        message = str(info.value)
        assert dead in message and "s3_endpoint_url" in message
        assert os.environ["AWS_SECRET_ACCESS_KEY"] not in message
        assert os.environ["AWS_ACCESS_KEY_ID"] not in message


@pytest.mark.integration
def test_s3_missing_bucket_is_named(s3_server: StoreConfig) -> None:
    store = S3Store(s3_server.model_copy(update={"uri": "s3://no-such-aerie-bucket/p"}))
    with pytest.raises(StoreError, match="bucket 'no-such-aerie-bucket' does not exist"):
        store.exists("run/manifest.json")  # HEAD 404 alone cannot tell a missing bucket from a missing key
    with pytest.raises(StoreError, match="bucket 'no-such-aerie-bucket' does not exist"):
        store.put_bytes("run/manifest.json", b"{}")


@pytest.mark.integration
def test_s3_sweeps_uploads_a_killed_process_left(s3_config: StoreConfig) -> None:
    store = S3Store(s3_config)
    client = raw_client(s3_config)
    full = full_key(store, "run/shard.bin")
    # What a SIGKILLed uploader leaves: a multipart upload with a part and no complete/abort.
    upload = client.create_multipart_upload(Bucket=store.bucket, Key=full)
    client.upload_part(
        Bucket=store.bucket, Key=full, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1024
    )
    # moto reports every upload as initiated in 2010, so the age cut-off cannot be exercised here.
    assert store.abort_incomplete_uploads(older_than_s=0) == 1
    assert leftovers(store) == []
    assert not store.exists("run/shard.bin")


@pytest.mark.integration
def test_s3_source_changed_during_upload_is_refused(s3_config: StoreConfig, tmp_path: Path) -> None:
    """The sha256 is computed before the upload starts (S3 metadata is fixed at its start); a file
    still being written meanwhile would get a digest that does not describe it."""
    store = S3Store(s3_config)
    src = tmp_path / "growing.bin"
    src.write_bytes(os.urandom(MULTIPART_FILE_MB << 20))

    def append_once(request: Any, **kwargs: Any) -> None:
        if parse_qs(urlsplit(request.url).query).get("partNumber") == ["2"]:
            with open(src, "ab") as f:
                f.write(b"late bytes")

    store.client.meta.events.register_first("before-send.s3.UploadPart", append_once)
    with pytest.raises(StoreError, match="changed while it was uploaded"):
        store.put_file("run/growing.bin", src)
    assert not store.exists("run/growing.bin")


@pytest.mark.integration
def test_s3_object_replaced_during_download_is_refused(s3_config: StoreConfig, tmp_path: Path) -> None:
    """Ranged GETs are pinned to the ETag whose sha256 was read: a writer replacing the object
    between two parts makes the download fail instead of mixing two objects."""
    store = S3Store(s3_config)
    store.put_bytes("run/shard.bin", os.urandom(MULTIPART_FILE_MB << 20))
    client = raw_client(s3_config)
    replaced: list[bool] = []

    def replace_before_last_range(request: Any, **kwargs: Any) -> None:
        if not replaced and request.headers.get("Range", b"").startswith(b"bytes=10485760-"):
            client.put_object(Bucket=store.bucket, Key=full_key(store, "run/shard.bin"), Body=b"new")
            replaced.append(True)

    store.client.meta.events.register("before-send.s3.GetObject", replace_before_last_range)
    dest = tmp_path / "shard.bin"
    with pytest.raises(StoreError, match="changed meanwhile"):
        store.get_file("run/shard.bin", dest)
    assert replaced and not dest.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.integration
def test_an_unreachable_store_is_an_error_never_not_cached(s3_server: StoreConfig) -> None:
    """The cache probe (`StageDir.manifest`) with the default retry settings: an endpoint where nothing
    listens raises, naming endpoint and bucket, instead of answering "not cached"."""
    dead = f"http://127.0.0.1:{free_port()}"
    store = S3Store(StoreConfig(uri="s3://aerie-test/run-root", s3_endpoint_url=dead, s3_region="us-east-1"))
    with pytest.raises(StoreError) as info:
        StageDir(store, "run", "generate-x", "0123456789abcdef").manifest()
    message = str(info.value)
    assert f"cannot reach the S3 endpoint {dead} for bucket 'aerie-test'" in message
    assert "2 attempt(s)" in message and "s3_endpoint_url" in message
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in message


@pytest.mark.integration
def test_an_endpoint_that_accepts_and_never_answers_fails_on_first_contact(s3_server: StoreConfig) -> None:
    with socket.socket() as silent:  # the kernel accepts connections into the backlog; nobody reads
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cfg = s3_server.model_copy(update={"s3_endpoint_url": url, "s3_first_contact_timeout_s": 0.5})
        with pytest.raises(StoreError, match=r"cannot reach the S3 endpoint .* \(ReadTimeoutError"):
            S3Store(cfg).exists("run/manifest.json")


def test_a_corrupt_manifest_means_not_complete(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "artifacts")
    stage = StageDir(store, "run", "merge", "0123456789abcdef")
    store.put_bytes(stage.path("manifest.json"), b'{"figures": {}}')
    assert stage.manifest() == {"figures": {}}
    corrupt(store, stage.path("manifest.json"))
    assert stage.manifest() is None  # the stage re-runs and rewrites it
    store.put_bytes(stage.path("manifest.json"), b"[1, 2]")
    assert stage.manifest() is None
