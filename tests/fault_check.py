"""What a faulted run left, compared with what an unfaulted run leaves, item by item.

A snapshot holds, per kind of output, every item by its natural id with the sha256 of its content
(conversations by conversation id, corpus rows and hidden-state samples by split and sample id, the
drafter's files by path, evaluation answers by dataset, prompt and proposer, serving rows by server and
concurrency), each stage's manifest with what legitimately varies removed (times, speeds and what
follows from them, how this run got there: resumed rows, reused answers, restarts; a measured numeric
error compares as within or over its tolerance), and how many
requests a generation journal holds twice. `compare` counts, against the unfaulted snapshot:

- lost: an item the unfaulted run has and this one lacks;
- duplicated: an item present more than once (or a stage completed twice, a request journaled twice);
- changed: an item present in both whose content differs;
- extra: an item only this run has;
- and names every manifest field that differs.

Nothing here starts a process: tests/test_fault_check.py plants each kind of damage and checks that it
is counted. Used by the fault matrix (tests/faults).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STAGES = ["generate-sharegpt", "merge", "extract", "train", "evaluate", "deploy"]

# Manifest and record fields that vary between two unfaulted runs of the same inputs, by name:
# clock times and durations, speeds and what is decided from a speed (deploy's promotion and the server
# it recommends), estimates.
VOLATILE = re.compile(
    r"(_s|_ms|_unix|seconds|per_s|per_second|_share|share|tok_s(_c\d+)?)$"
    r"|^(created_unix|plan|phases|throughput|commit_path|speedup|promoted|promotion|reason|elapsed_s)$"
    r"|^recommendation$"
    r"|latency|ttft|itl_|estimate"
    # A served speed's repetitions and their spread (the deployment benchmark's steady-state levels).
    r"|per_s_runs$|^spread$"
    # The free space of the disks the run checked before it began.
    r"|^preflight$"
    # The sha256 of an upstream manifest, which holds that stage's times.
    r"|^manifest_sha256$"
)
# A stage's key is derived from its inputs' manifests, times included: it differs between two unfaulted
# runs, so keys (16 hex digits, alone or in a path) compare as a placeholder; so do the random 32-digit
# ids a server start is given (its weight version).
STAGE_KEY = re.compile(r"\b[0-9a-f]{16}\b|\b[0-9a-f]{32}\b")
# Fields that say how a run reached its result (what it resumed, reused, retried or restarted), which a
# fault changes by design; the result itself is compared through everything else.
HISTORY = frozenset(
    {
        "runs",
        "reused",
        "regenerated",
        "changed",
        "done_in_earlier_runs",
        "resumed_rows",
        "extracted_tokens_this_run",
        "server_restarts",
        "restarts",
        "retries_by_kind",
        "retries",
        "models_served",
    }
)


def sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


# Measurements of a server's numerics against a reference forward (the extraction canary's relative
# errors): floating-point figures of how the computation ran (thread counts, the machine's load), like a
# time, not of what was produced (the samples are compared bit for bit). Each compares as the verdict it
# feeds, within or over the `rtol` beside it; with no tolerance in reach, not at all.
MEASURED = re.compile(r"rel_err$")


def normalize(value: Any, subs: Iterable[tuple[str, str]] = (), rtol: float | None = None) -> Any:
    """`value` without the volatile and history fields, at any depth; `subs` rewrite strings (a scratch
    folder's name) so two runs in different folders compare equal; a measured error becomes whether it
    is within the nearest enclosing `rtol`."""
    subs = list(subs)
    if isinstance(value, dict):
        rtol = value["rtol"] if isinstance(value.get("rtol"), (int, float)) else rtol
        out = {}
        for k, v in value.items():
            if k in HISTORY or VOLATILE.search(k):
                continue
            if MEASURED.search(k) and isinstance(v, (int, float)):
                if rtol is not None:
                    out[k] = "within rtol" if v <= rtol else f"over rtol ({v:.3g} > {rtol})"
                continue
            out[k] = normalize(v, subs, rtol)
        return out
    if isinstance(value, list):
        return [normalize(v, subs, rtol) for v in value]
    if isinstance(value, str):
        for old, new in subs:
            value = value.replace(old, new)
        return STAGE_KEY.sub("<key>", value)
    return value


@dataclass
class Snapshot:
    items: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # kind -> [(id, sha256)]
    manifests: dict[str, Any] = field(default_factory=dict)  # stage -> normalized manifest
    completed: Counter[str] = field(default_factory=Counter)  # stage -> manifests found
    asked_twice: int = 0  # journal records repeating an (id, input) already journaled

    def add(self, kind: str, item_id: str, content: Any) -> None:
        body = content if isinstance(content, bytes) else canonical(content)
        self.items.setdefault(kind, []).append((item_id, sha(body)))


@dataclass
class Verdict:
    lost: int = 0
    duplicated: int = 0
    changed: int = 0
    extra: int = 0
    differences: list[str] = field(default_factory=list)  # one line per difference, the first ones

    @property
    def equal(self) -> bool:
        return not (self.lost or self.duplicated or self.changed or self.extra or self.differences)

    def summary(self) -> str:
        head = f"lost {self.lost}, duplicated {self.duplicated}, changed {self.changed}, extra {self.extra}"
        return head + (f"; {'; '.join(self.differences[:6])}" if self.differences else "")


def compare(want: Snapshot, got: Snapshot) -> Verdict:
    """`got` (after a fault and a re-run) against `want` (an unfaulted run), item by item."""
    v = Verdict()
    for kind in sorted(set(want.items) | set(got.items)):
        w = dict(want.items.get(kind, []))
        g_list = got.items.get(kind, [])
        counts = Counter(i for i, _ in g_list)
        g = dict(g_list)
        lost = sorted(set(w) - set(g))
        extra = sorted(set(g) - set(w))
        changed = sorted(i for i in set(w) & set(g) if w[i] != g[i])
        dup = sum(n - 1 for n in counts.values())
        # An item repeated in the unfaulted run too (two identical answers) is not a fault's duplicate.
        dup -= sum(n - 1 for n in Counter(i for i, _ in want.items.get(kind, [])).values())
        v.lost += len(lost)
        v.extra += len(extra)
        v.changed += len(changed)
        v.duplicated += max(dup, 0)
        for what, ids in (("lost", lost), ("extra", extra), ("changed", changed)):
            if ids:
                v.differences.append(f"{kind}: {len(ids)} {what} ({', '.join(ids[:3])})")
        if dup > 0:
            twice = sorted(i for i, n in counts.items() if n > 1)
            v.differences.append(f"{kind}: {dup} duplicated ({', '.join(twice[:3])})")
    for stage in sorted(set(want.manifests) | set(got.manifests)):
        if stage not in got.manifests:
            v.lost += 1
            v.differences.append(f"{stage}: no manifest")
            continue
        if stage not in want.manifests:
            v.extra += 1
            v.differences.append(f"{stage}: a manifest the unfaulted run has not")
            continue
        for path, a, b in diff_values(want.manifests[stage], got.manifests[stage]):
            v.differences.append(f"{stage} manifest {path}: {short(a)} -> {short(b)}")
    for stage, n in got.completed.items():
        if n > max(1, want.completed.get(stage, 1)):
            v.duplicated += n - 1
            v.differences.append(f"{stage}: {n} completed outputs")
    if got.asked_twice > want.asked_twice:
        v.duplicated += got.asked_twice - want.asked_twice
        v.differences.append(f"journal: {got.asked_twice} requests journaled twice")
    return v


def diff_values(a: Any, b: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            yield from diff_values(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{path}.{k}" if path else k)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from diff_values(x, y, f"{path}[{i}]")
    elif a != b:
        yield path, a, b


def short(value: Any) -> str:
    text = canonical(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- snapshots of real outputs ------------------------------------------------------------------------


def add_conversations(snap: Snapshot, parquet: Path) -> None:
    import polars as pl

    for row in pl.read_parquet(parquet).iter_rows(named=True):
        snap.add("conversations", row["id"], row["messages"])


def add_journal(snap: Snapshot, journal_dir: Path) -> None:
    """Requests journaled twice: the same conversation id from the same input answered again."""
    seen: Counter[tuple[str, str, str]] = Counter()
    for part in sorted(journal_dir.rglob("part-*.jsonl")):
        for line in part.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line (a killed writer): not a record
            seen[(rec.get("params_hash", ""), rec["id"], rec.get("input_sha256") or "")] += 1
    snap.asked_twice += sum(n - 1 for n in seen.values())


def add_manifest(
    snap: Snapshot, stage: str, manifest: dict[str, Any], subs: Iterable[tuple[str, str]]
) -> None:
    snap.manifests[stage] = normalize(manifest, subs)
    snap.completed[stage] += 1


def generation_snapshot(
    stage_dir: Path, journal_dir: Path | None = None, subs: Iterable[tuple[str, str]] = ()
) -> Snapshot:
    """A generation stage's output folder (conversations.parquet and manifest.json, as a LocalStore or a
    download keeps them) and, optionally, its journal."""
    snap = Snapshot()
    add_conversations(snap, stage_dir / "conversations.parquet")
    manifest = json.loads((stage_dir / "manifest.json").read_text())
    # The output's own hash and size follow from its rows, compared above; files' keys name the run.
    manifest.pop("files", None)
    add_manifest(snap, "generate", manifest, subs)
    if journal_dir is not None:
        add_journal(snap, journal_dir)
    return snap


def run_snapshot(run_dir: Path, subs: Iterable[tuple[str, str]] = ()) -> Snapshot:
    """Everything the pipeline's stages left under one run of a LocalStore (`<store>/<run>`)."""
    snap = Snapshot()
    for stage in STAGES:
        manifests = sorted((run_dir / stage).glob("*/manifest.json"))
        for path in manifests:
            add_manifest(snap, stage, json.loads(path.read_text()), subs)
        if not manifests:
            continue
        out = manifests[-1].parent
        {
            "generate-sharegpt": add_generation_output,
            "merge": add_corpus_rows,
            "extract": add_hidden_samples,
            "train": add_drafter,
            "evaluate": add_evaluation,
            "deploy": add_serving_rows,
        }[stage](snap, out, subs)
    journal = run_dir / "generate-sharegpt" / "journal"
    if journal.is_dir():
        add_journal(snap, journal)
    return snap


def add_generation_output(snap: Snapshot, out: Path, subs: Iterable[tuple[str, str]]) -> None:
    add_conversations(snap, out / "conversations.parquet")


def add_corpus_rows(snap: Snapshot, out: Path, subs: Iterable[tuple[str, str]]) -> None:
    import polars as pl

    for shard in sorted(out.glob("*-0*.parquet")):
        split = shard.name.split("-")[0]
        for row in pl.read_parquet(shard).iter_rows(named=True):
            snap.add("merge rows", f"{split}/{row['id']}", row)


def add_hidden_samples(snap: Snapshot, out: Path, subs: Iterable[tuple[str, str]]) -> None:
    """Each stored sample by split and id: its tokens, loss mask and hidden states, bit for bit."""
    from aerie.shards.reader import ShardReader

    for shard in sorted((out / "shards").rglob("*.safetensors")):
        split = shard.parent.name
        for s in ShardReader(shard):
            parts = [s.input_ids, s.loss_mask, s.aux_hidden, s.last_hidden]
            body = b"".join(t.contiguous().view(-1).view(dtype=_u8()).numpy().tobytes() for t in parts)
            snap.add("hidden samples", f"{split}/{s.id}", body)


def _u8() -> Any:
    import torch

    return torch.uint8


# The drafter's card (README.md) states measured times (training wall time, served tokens/s): they
# differ run to run, so it is compared without them; its digest sidecar follows its bytes.
CARD = "README.md"


def card_without_measurements(text: str) -> str:
    kept, served = [], False
    for line in text.splitlines():
        if line.startswith("## "):
            served = line.startswith("## Served")
        if not (served and not line.startswith("## ")) and not line.startswith("| training wall time"):
            kept.append(line)
    return "\n".join(kept)


def add_drafter(snap: Snapshot, out: Path, subs: Iterable[tuple[str, str]]) -> None:
    """The drafter's files bit for bit (its card without measured times), and each metrics line (train
    and eval steps) without its times."""
    for path in sorted((out / "drafter").rglob("*")):
        if not path.is_file() or path.name == f".{CARD}.sha256":
            continue
        key = str(path.relative_to(out))
        if path.name == CARD:
            snap.add("drafter files", key, normalize(card_without_measurements(path.read_text()), subs))
        else:
            snap.add("drafter files", key, path.read_bytes())
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            rec = json.loads(line)
            snap.add("train metrics", f"{rec.get('kind')}/{rec.get('step')}", normalize(rec, subs))


def add_evaluation(snap: Snapshot, out: Path, subs: Iterable[tuple[str, str]]) -> None:
    for line in (out / "per_prompt.jsonl").read_text().splitlines():
        rec = json.loads(line)
        key = "/".join(str(rec.get(k)) for k in ("dataset", "id", "proposer", "num_steps", "temperature"))
        snap.add("evaluation answers", key, normalize(rec, subs))


def add_serving_rows(snap: Snapshot, out: Path, subs: Iterable[tuple[str, str]]) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    for row in manifest.get("rows", []):
        snap.add("serving rows", f"{row.get('server')}/c{row.get('concurrency')}", normalize(row, subs))
