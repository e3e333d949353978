"""Artifact store throughput: put_file / get_file / get_bytes of one large file, for LocalStore (a temp
dir) and S3Store against a local moto server process. Writes benchmarks/results/store-cpu.json.

    .venv/bin/python benchmarks/stages/store.py [--size-mb 256] [--repeat 2] [--chunk-mb 64] [--concurrency 8]

moto is a single Python process that keeps objects in memory, so the S3 figures measure aerie's client
path (hash, multipart, verify) against a slow server, not what AWS or MinIO would sustain. The sha256
figure is the ceiling for both stores: every upload and download hashes every byte once (an S3 upload
reads the file twice: a hash pass, then the transfer). `adopt_file` into a LocalStore on the same
filesystem is a hash-and-fsync pass plus a rename: no second write.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import boto3

from aerie.store import ArtifactStore, StoreConfig, open_store, sha256_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository importable
from benchmarks import records  # noqa: E402

OUT = records.RESULTS / "store-cpu.json"
CODE_PATHS = ["benchmarks/stages/store.py", "aerie/store.py", "aerie/s3store.py"]
BUCKET = "aerie-bench"


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server process on a free 127.0.0.1 port, with dummy credentials in our env."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url, timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        boto3.client("s3", endpoint_url=url).create_bucket(Bucket=BUCKET)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    """Best of `repeat` runs: the machine is shared, the minimum is the least disturbed."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def adopt_seconds(store: ArtifactStore, src: Path, work: Path, key: str, repeat: int) -> float:
    """Best of `repeat` adopt_file calls, each on a fresh copy of `src` (copied untimed: a shard the
    extractor has just written, still in the page cache)."""
    best = float("inf")
    for _ in range(repeat):
        fresh = work / "adopt.bin"
        shutil.copyfile(src, fresh)
        start = time.perf_counter()
        store.adopt_file(key, fresh)
        best = min(best, time.perf_counter() - start)
    return best


def measure(store: ArtifactStore, src: Path, work: Path, repeat: int) -> dict[str, float]:
    mib = src.stat().st_size / 2**20
    key = "bench/shard-00000.bin"
    put = best_seconds(lambda: store.put_file(key, src), repeat)
    adopt = adopt_seconds(store, src, work, key, repeat)
    dest = work / "down.bin"
    get = best_seconds(lambda: store.get_file(key, dest), repeat)
    dest.unlink()
    get_bytes = best_seconds(lambda: store.get_bytes(key), repeat)
    store.delete(key)
    return {
        "put_file_mib_per_s": round(mib / put, 1),
        "adopt_file_mib_per_s": round(mib / adopt, 1),
        "get_file_mib_per_s": round(mib / get, 1),
        "get_bytes_mib_per_s": round(mib / get_bytes, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--chunk-mb", type=int, default=64, help="S3 multipart part size (MiB)")
    parser.add_argument("--concurrency", type=int, default=8, help="S3 parts in flight")
    args = parser.parse_args()

    figures: dict[str, object] = {"size_mib": args.size_mb, "chunk_mib": args.chunk_mb}
    with tempfile.TemporaryDirectory(prefix="aerie-bench-store-") as tmp:
        work = Path(tmp)
        src = work / "src.bin"
        with open(src, "wb") as f:
            for _ in range(args.size_mb):
                f.write(os.urandom(1 << 20))
        figures["sha256_mib_per_s"] = round(
            args.size_mb / best_seconds(lambda: sha256_file(src), args.repeat), 1
        )
        figures["local"] = measure(open_store(str(work / "artifacts")), src, work, args.repeat)
        with moto_server() as url:
            cfg = StoreConfig(
                uri=f"s3://{BUCKET}/bench",
                s3_endpoint_url=url,
                s3_region="us-east-1",
                multipart_chunk_mb=args.chunk_mb,
                max_concurrency=args.concurrency,
            )
            figures["s3_moto"] = measure(open_store(cfg), src, work, args.repeat)

    machine = records.machine(f"load avg {os.getloadavg()[0]:.1f}")
    records.write(OUT, {**records.header(CODE_PATHS, machine), "figures": figures})


if __name__ == "__main__":
    main()
