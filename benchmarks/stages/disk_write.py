"""How fast this machine's disk takes shard-sized writes, by write method, over a long run.

    python benchmarks/stages/disk_write.py [--dir D] [--file-mib 1024] [--rounds 4] [--methods ...] [--tag T]

An extraction writes tens of GB of ~1 GiB shards, and on the H200 hosts that is its bound: buffered
writes + fsync (what `save_file` and aerie's shard writer do) ran at 1.3-1.5 GB/s for the first GiB
and 0.85-1.1 GB/s after. This measures the methods a shard writer could use, on the same disk, with
the files interleaved (round 1: every method once, then round 2, ...), so a disk that slows down as its
burst allowance drains slows every method alike:

- `buffered`: `os.write` of 64 MiB chunks into the page cache, then fsync (the kernel's writeback);
- `direct-t<T>-c<C>`: O_DIRECT (no page cache), T threads each `pwrite`-ing C MiB chunks of the file
  at their own offsets, so the device sees up to T writes in flight; then fsync (metadata).

Standard library only, so it runs on a bare host. Writes `benchmarks/results/disk_write[-T].json`:
per method the MB/s of every file in order, the best, and the mean over all files (bytes / seconds).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import subprocess
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

MIB = 1 << 20
BUFFERED_CHUNK = 64 * MIB


def _buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned memory (O_DIRECT needs aligned buffers), filled so the pages exist."""
    buf = mmap.mmap(-1, nbytes)
    pattern = os.urandom(MIB)
    for off in range(0, nbytes, MIB):
        buf[off : off + MIB] = pattern[: min(MIB, nbytes - off)]
    return buf


def write_buffered(path: Path, size: int, buf: mmap.mmap) -> None:
    view = memoryview(buf)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, size, BUFFERED_CHUNK):
            n = min(BUFFERED_CHUNK, size - off)
            done = 0
            while done < n:
                done += os.write(fd, view[off + done : off + n])
        os.fsync(fd)
    finally:
        os.close(fd)


def write_direct(path: Path, size: int, buf: mmap.mmap, threads: int, chunk: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    view = memoryview(buf)
    errors: list[BaseException] = []

    def stripe(t: int) -> None:
        try:
            for off in range(t * chunk, size, threads * chunk):
                n = min(chunk, size - off)
                done = 0
                while done < n:
                    done += os.pwrite(fd, view[off + done : off + n], off + done)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    try:
        workers = [threading.Thread(target=stripe, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if errors:
            raise errors[0]
        os.fsync(fd)
    finally:
        os.close(fd)


def parse_method(name: str) -> tuple[int, int] | None:
    """None for `buffered`, else (threads, chunk bytes) of `direct-t<T>-c<C>`."""
    if name == "buffered":
        return None
    kind, t, c = name.split("-")
    if kind != "direct" or not t.startswith("t") or not c.startswith("c"):
        raise SystemExit(f"unknown method {name!r}: buffered or direct-t<T>-c<C>")
    return int(t[1:]), int(c[1:]) * MIB


def describe_disk(folder: Path) -> dict[str, str]:
    """What the folder is on, as far as the usual tools say (each may be missing on a bare host)."""
    out = {}
    for key, cmd in {
        "df": ["df", "-T", str(folder)],
        "lsblk": ["lsblk", "-d", "-o", "NAME,ROTA,TYPE,SIZE,MODEL"],
        "mount": ["findmnt", "-T", str(folder)],
    }.items():
        try:
            out[key] = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            out[key] = f"unavailable: {exc}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="where to write (default: a new folder in the temp dir)")
    ap.add_argument("--file-mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4, help="files per method")
    ap.add_argument("--methods", default="buffered,direct-t1-c64,direct-t4-c16,direct-t8-c8")
    ap.add_argument("--tag", default="", help="results go to disk_write-<tag>.json")
    args = ap.parse_args()
    folder = Path(args.dir or tempfile.mkdtemp(prefix="aerie-disk-"))
    folder.mkdir(parents=True, exist_ok=True)
    size = args.file_mib * MIB
    methods = args.methods.split(",")
    plans = {m: parse_method(m) for m in methods}
    buf = _buffer(size)
    rates: dict[str, list[float]] = {m: [] for m in methods}
    seconds: dict[str, float] = dict.fromkeys(methods, 0.0)
    for r in range(args.rounds):
        for m in methods:
            path = folder / f"disk-write-{r}-{m}"
            began = time.perf_counter()
            plan = plans[m]
            if plan is None:
                write_buffered(path, size, buf)
            else:
                write_direct(path, size, buf, *plan)
            took = time.perf_counter() - began
            path.unlink()
            rates[m].append(round(size / took / 1e6))
            seconds[m] += took
            print(f"round {r} {m}: {size / took / 1e6:,.0f} MB/s", flush=True)
    figures: dict[str, Any] = {
        "file_mib": args.file_mib,
        "rounds": args.rounds,
        "order": "interleaved: each round writes one file per method, in the order listed",
        "methods": {
            m: {
                "mb_per_s_by_file": rates[m],
                "best_mb_per_s": max(rates[m]),
                "mean_mb_per_s": round(args.rounds * size / seconds[m] / 1e6),
            }
            for m in methods
        },
        "disk": describe_disk(folder),
    }
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "command": "python benchmarks/stages/disk_write.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, "")),
        "figures": figures,
    }
    name = f"disk_write-{args.tag}.json" if args.tag else "disk_write.json"
    out = Path(__file__).resolve().parents[1] / "results" / name
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(figures["methods"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
