"""`pack-out`: what must outlive the host, in groups by priority, as `state.tgz.NNN` parts + `state.json`."""

from __future__ import annotations

import hashlib
import io
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from aerie.bundle.files import FORMAT, MIB, size_text, write_json
from aerie.bundle.layout import InstallDir as Home
from tools.gpuhost.hostenv import REPO
from tools.gpuhost.limits import LOG_TAIL_BYTES, MAX_PARTS, OUT_MB, PART_BYTES

STATE_INDEX = "state.json"
STATE_PART = "state.tgz.{:03d}"
# Stage directories whose every file travels (the others travel filtered, `_travelling`).
WHOLE_STAGES = ("generate-", "import-", "merge")


@dataclass
class Group:
    """Files that travel together or not at all (a stage directory is restorable only whole)."""

    name: str
    priority: int
    files: list[tuple[Path, str]] = field(default_factory=list)  # (path here, name in the archive)

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p, _ in self.files)


def _key_dirs(store: Path) -> Iterator[tuple[str, Path]]:
    """(stage, dir) for every `<run>/<stage>/<key or journal>` directory of a local store."""
    if not store.is_dir():
        return
    for run in sorted(p for p in store.iterdir() if p.is_dir()):
        for stage_dir in sorted(p for p in run.iterdir() if p.is_dir()):
            for sub in sorted(p for p in stage_dir.iterdir() if p.is_dir()):
                yield stage_dir.name, sub


def _files(
    root: Path, base: Path, prefix: str, keep: Callable[[str], bool] | None = None
) -> list[tuple[Path, str]]:
    """Regular files under `root` (hidden temp files left out), named `prefix/<path relative to base>`."""
    return [
        (p, f"{prefix}/{p.relative_to(base).as_posix()}")
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and not p.name.startswith(".")
        and (keep is None or keep(p.relative_to(root).as_posix()))
    ]


def _travelling(stage: str) -> Callable[[str], bool] | None:
    """Which files of a finished stage travel (None: all). Never the hidden-state shards, cheaper to
    re-extract than to move: an extraction travels as its manifest alone, which later stages' keys
    are made of, and the pipeline extracts again only if a stage that reads shards has to run
    (`aerie.pipeline.rebuild_missing`). Never training checkpoints either: the drafter is the result."""
    if stage == "extract":
        return lambda rel: rel == "manifest.json"
    if stage == "train":
        return lambda rel: not rel.startswith("checkpoints/")
    return None


def _store_groups(store: Path) -> list[Group]:
    """Every finished stage, restorable (a fresh host takes it as a cache hit): generation, import
    and merge whole, an extraction as its manifest, training without its checkpoints, evaluation and
    deployment whole; and journals (they resume an unfinished generation)."""
    finished = {
        (sub.parent.parent.name, stage)
        for stage, sub in _key_dirs(store)
        if (sub / "manifest.json").is_file()
    }
    groups: list[Group] = []
    for stage, sub in _key_dirs(store):
        name = f"store/{sub.relative_to(store).as_posix()}"
        if sub.name == "journal":
            prio = 6 if (sub.parent.parent.name, stage) in finished else 2
            groups += [Group(f"store/{j.relative_to(store).as_posix()}", prio, _files(j, store, "store"))
                       for j in sorted(p for p in sub.iterdir() if p.is_dir())]  # fmt: skip
        elif not (sub / "manifest.json").is_file():
            continue  # unfinished: its journal or checkpoints resume it, not its partial files
        elif stage.startswith(WHOLE_STAGES):
            groups.append(Group(name, 4 if stage == "merge" else 1, _files(sub, store, "store")))
        else:
            prio = 0 if stage == "extract" else 3
            groups.append(Group(name, prio, _files(sub, store, "store", _travelling(stage))))
    return groups


def _log_tails(home: Home, work: Path, keep_bytes: int = LOG_TAIL_BYTES) -> list[tuple[Path, str]]:
    """The last `keep_bytes` of each run log (the end says how a run stopped)."""
    out = []
    for log in sorted((home.root / "logs").glob("*.log")):
        tail = work / log.name
        with open(log, "rb") as src, open(tail, "wb") as dst:
            src.seek(max(log.stat().st_size - keep_bytes, 0))
            shutil.copyfileobj(src, dst)
        out.append((tail, f"results/logs/{log.name}"))
    return out


def collect_groups(home: Home, work: Path, since: float | None = None) -> list[Group]:
    """Everything worth carrying back, most valuable first.

    0 extraction manifests (later stages' keys are made of them) and the staging index; 1 finished
    generation and import stages; 2 journals of unfinished generations; 3 training (drafter,
    metrics, plots), evaluation and deployment; 4 the merged corpus (minutes of CPU to redo); 5 run
    logs and the benchmark JSONs written since `since`; 6 journals of finished generations (their
    Parquet holds them)."""
    groups = _store_groups(home.store)
    if home.index_path.is_file():
        groups.append(Group("results/staging-index", 0, [(home.index_path, "results/staging-index.json")]))
    extra = Group("results/logs+benchmarks", 5, _log_tails(home, work))
    bench = REPO / "benchmarks" / "results"
    if since is not None and bench.is_dir():
        extra.files += [(p, f"results/benchmarks/{p.name}") for p in sorted(bench.glob("*.json"))
                        if p.stat().st_mtime >= since]  # fmt: skip
    groups.append(extra)
    return sorted((g for g in groups if g.files), key=lambda g: g.priority)


def pack_limits(args: Any) -> dict[str, int]:
    """`pack_out`'s size limits from the parsed `--max-out-mb`, `--part-mb` and `--max-parts` options."""
    return {
        "max_bytes": int(args.max_out_mb * MIB),
        "part_bytes": int(args.part_mb * MIB),
        "max_parts": int(args.max_parts),
    }


class _PartWriter(io.RawIOBase):
    """One byte stream written as consecutive files of at most `part_bytes` each, hashed as it goes."""

    def __init__(self, out: Path, part_bytes: int = PART_BYTES) -> None:
        super().__init__()
        self.out, self.part_bytes = out, part_bytes
        self.parts: list[dict[str, Any]] = []
        self._f: IO[bytes] | None = None
        self._digest = hashlib.sha256()
        self._size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        while view:
            if self._f is None or self._size == self.part_bytes:
                self._next()
            assert self._f is not None
            n = min(len(view), self.part_bytes - self._size)
            self._f.write(view[:n])
            self._digest.update(view[:n])
            self._size += n
            view = view[n:]
        return len(data)

    def _next(self) -> None:
        self._finish_part()
        name = STATE_PART.format(len(self.parts))
        self.parts.append({"file": name})
        self._f = open(self.out / name, "wb")  # noqa: SIM115 - open across write() calls, closed per part

    def _finish_part(self) -> None:
        if self._f is not None:
            self._f.close()
            self.parts[-1].update(size=self._size, sha256=self._digest.hexdigest())
            self._f, self._digest, self._size = None, hashlib.sha256(), 0

    def close(self) -> None:
        self._finish_part()
        super().close()


def pack_out(
    home: Home,
    out: Path,
    *,
    max_bytes: int = int(OUT_MB * MIB),
    since: float | None = None,
    part_bytes: int = PART_BYTES,
    max_parts: int = MAX_PARTS,
) -> dict[str, Any]:
    """Write what must outlive the host into `out`: `state.tgz.NNN` parts (gzip members of one tar
    archive per group, cut every `part_bytes`) and `state.json` (the parts with their sha256, what was
    taken, and what was left behind and why). A group is taken whole or not at all, in priority order,
    while the total stays within `max_bytes` and, unless `max_parts` is 0, within `max_parts` parts (with
    the index, `max_parts + 1` files: what a link that takes a fixed number of files needs)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("state.*"):
        old.unlink()
    limit = min(max_bytes, max_parts * part_bytes) if max_parts else max_bytes
    taken: list[dict[str, Any]] = []
    left: list[dict[str, Any]] = []
    total = 0
    home.root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home.root, prefix=".pack-out-") as tmp:
        work = Path(tmp)
        writer = _PartWriter(out, part_bytes)
        for group in collect_groups(home, work, since):
            chunk = work / "group.tgz"
            with tarfile.open(chunk, "w:gz", compresslevel=6) as tar:
                for path, name in group.files:
                    tar.add(path, arcname=name, recursive=False)
            size = chunk.stat().st_size
            info = {"group": group.name, "files": len(group.files), "bytes": group.size, "packed": size}
            if total + size > limit:
                left.append(
                    {
                        **info,
                        "why": f"the {size_text(total)} taken before it + {size_text(size)} > {size_text(limit)}",
                    }
                )
                continue
            with open(chunk, "rb") as f:
                shutil.copyfileobj(f, writer)
            total += size
            taken.append(info)
        writer.close()
    index = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "parts": writer.parts,
        "groups": taken,
        "left_behind": left,
    }
    write_json(out / STATE_INDEX, index)
    print(
        f"pack-out: {len(writer.parts)} part(s), {size_text(total)}, {len(taken)} groups in {out}", flush=True
    )
    for item in left:
        print(f"pack-out: LEFT BEHIND {item['group']} ({item['files']} files): {item['why']}", flush=True)
    return index
