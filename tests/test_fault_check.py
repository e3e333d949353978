"""The fault matrix's checker (tests/fault_check.py) counts what it exists to count: a conversation or a
corpus row lost, duplicated or changed, a manifest figure that differs, a request journaled twice, a
stage completed twice; and counts nothing for two copies of one output whose times differ. Real stage
outputs written by aerie's own writers; no process is started."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import polars as pl
import pytest

from aerie.generate.output import write_conversations
from aerie.store import LocalStore
from tests.extract_support import write_corpus
from tests.fault_check import Snapshot, add_manifest, compare, generation_snapshot, normalize, run_snapshot


def record(i: int, answer: str | None = None) -> dict:
    return {
        "id": f"c{i:03d}",
        "source": "toy",
        "messages": [
            {"role": "user", "content": f"question {i}", "reasoning": None},
            {"role": "assistant", "content": answer or f"answer {i}", "reasoning": None},
        ],
        "finish_reasons": ["stop"],
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "cost": None,
        "params_hash": "p",
        "input_sha256": f"in{i}",
    }


def generation_output(root: Path, records: list[dict], **figures: object) -> Path:
    """A generation stage's folder as the stage leaves it: conversations, manifest, journal."""
    out = root / "out"
    out.mkdir(parents=True)
    write_conversations(records, out / "conversations.parquet")
    manifest = {
        "key": "36b053578d459abc",
        "created_unix": 1.0,
        "figures": {"records": len(records), "failed": 0, "wall_s": 1.0, "requests_per_s": 9.0, **figures},
        "counts": {"requested": len(records), "reused": 0},
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    journal = root / "journal"
    journal.mkdir()
    (journal / "part-00001-aaaa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def snap(root: Path) -> Snapshot:
    return generation_snapshot(root / "out", root / "journal")


RECORDS = [record(i) for i in range(6)]


def test_an_identical_output_whose_times_and_history_differ_compares_equal(tmp_path: Path) -> None:
    want = snap(generation_output(tmp_path / "a", RECORDS))
    again = generation_output(tmp_path / "b", RECORDS, wall_s=7.5, requests_per_s=1.2)
    manifest = json.loads((again / "out" / "manifest.json").read_text())
    manifest["counts"]["reused"] = 4  # resumed from a journal: how it got there, not what it produced
    manifest["created_unix"] = 99.0
    (again / "out" / "manifest.json").write_text(json.dumps(manifest))
    verdict = compare(want, snap(again))
    assert verdict.equal, verdict.summary()


@pytest.mark.parametrize(
    ("damage", "counted"),
    [
        (lambda rs: rs[:2] + rs[3:], "lost"),
        (lambda rs: [*rs, rs[4]], "duplicated"),
        (lambda rs: [*rs[:1], record(1, "a stale answer"), *rs[2:]], "changed"),
        (lambda rs: [*rs, record(99)], "extra"),
    ],
    ids=["loss", "duplicate", "changed-content", "extra"],
)
def test_a_planted_conversation_fault_is_counted(
    tmp_path: Path, damage: Callable[[list[dict]], list[dict]], counted: str
) -> None:
    want = snap(generation_output(tmp_path / "a", RECORDS))
    got = snap(generation_output(tmp_path / "b", damage(RECORDS)))
    verdict = compare(want, got)
    assert getattr(verdict, counted) >= 1, verdict.summary()
    assert not verdict.equal
    others = {"lost", "duplicated", "changed", "extra"} - {counted}
    assert all(getattr(verdict, other) == 0 for other in others - {"duplicated"}), verdict.summary()
    assert "conversations" in " ".join(verdict.differences)


def test_a_request_journaled_twice_is_a_duplicate_even_with_a_clean_output(tmp_path: Path) -> None:
    want = snap(generation_output(tmp_path / "a", RECORDS))
    got = generation_output(tmp_path / "b", RECORDS)
    (got / "journal" / "part-00002-bbbb.jsonl").write_text(json.dumps(RECORDS[3]) + "\n{torn")
    verdict = compare(want, snap(got))
    assert verdict.duplicated == 1 and "journaled twice" in verdict.summary()


def test_a_changed_figure_is_named(tmp_path: Path) -> None:
    want = snap(generation_output(tmp_path / "a", RECORDS))
    verdict = compare(want, snap(generation_output(tmp_path / "b", RECORDS, failed=1)))
    assert not verdict.equal
    assert any("figures.failed: 0 -> 1" in line for line in verdict.differences), verdict.differences


def corpus_rows(n: int) -> list[dict]:
    return [
        {"id": f"r{i}", "source": "t", "input_ids": list(range(i, i + 8)), "loss_mask": [0] * 4 + [1] * 4}
        for i in range(n)
    ]


def test_corpus_rows_lost_duplicated_or_changed_and_a_stage_completed_twice_are_counted(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path / "a")
    write_corpus(store, "r", {"train": corpus_rows(12), "eval": corpus_rows(3)}, rows_per_shard=4)
    want = run_snapshot(tmp_path / "a" / "r")
    assert len(want.items["merge rows"]) == 15
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert compare(want, run_snapshot(tmp_path / "b" / "r")).equal

    (stage,) = (tmp_path / "b" / "r" / "merge").iterdir()
    first, second = stage / "train-00000.parquet", stage / "train-00001.parquet"
    rows = pl.read_parquet(first)
    rows[1:].write_parquet(first)  # r0 lost
    extra = pl.read_parquet(second)
    changed = extra.with_columns(
        pl.when(pl.col("id") == "r5").then(pl.col("input_ids").list.reverse()).otherwise(pl.col("input_ids"))
    )
    pl.concat([changed, rows[1:2]]).write_parquet(second)  # r1 twice; r5's tokens changed
    verdict = compare(want, run_snapshot(tmp_path / "b" / "r"))
    assert (verdict.lost, verdict.duplicated, verdict.changed) == (1, 1, 1), verdict.summary()

    shutil.copytree(stage, stage.parent / "0123456789abcdef")  # the stage's output written twice
    verdict = compare(want, run_snapshot(tmp_path / "b" / "r"))
    assert any("2 completed outputs" in line for line in verdict.differences), verdict.summary()


def extract_manifest(*errors: float, last: float = 1e-7) -> dict:
    """An extract manifest's canary as the stage records it: each block's relative error against the
    reference forward, and the tolerance they were checked against."""
    blocks = [
        {"block": k, "expected": k, "best": k, "rel_err": e, "best_rel_err": e} for k, e in enumerate(errors)
    ]
    numeric = {"blocks": blocks, "last_rel_err": last, "rtol": 0.05}
    return {"figures": {"samples": 8}, "canary": {"tokens": 12, "numeric": numeric}}


def extract_snapshot(manifest: dict) -> Snapshot:
    snap = Snapshot()
    add_manifest(snap, "extract", manifest, ())
    return snap


def test_a_canarys_measured_error_compares_against_its_tolerance_not_for_equality() -> None:
    """Two extractions with bit-identical samples measure the server's numerics differently (1.5e-07
    against 7.7e-06, seen): equal while both are within the tolerance, a difference once one is not."""
    want = extract_snapshot(extract_manifest(1.5e-7, 2.0e-7))
    assert compare(want, extract_snapshot(extract_manifest(7.7e-6, 1.1e-5, last=3e-6))).equal
    verdict = compare(want, extract_snapshot(extract_manifest(1.5e-7, 0.2)))
    assert not verdict.equal
    assert any("blocks[1].rel_err" in line and "over rtol" in line for line in verdict.differences), verdict
    verdict = compare(want, extract_snapshot({**extract_manifest(1.5e-7, 2.0e-7), "figures": {"samples": 7}}))
    assert any("figures.samples: 8 -> 7" in line for line in verdict.differences), verdict.differences


def test_a_served_speeds_repetitions_and_spread_are_times_but_its_tokens_are_compared() -> None:
    """The deployment benchmark's rows keep each repetition's speed and their spread (how fast the
    machine ran, as a time is); the tokens each level produced are what it made."""

    def served(speeds: list[float], tokens: int) -> Snapshot:
        row = {"server": "baseline", "concurrency": 1, "output_tokens": tokens}
        row |= {"tokens_per_s_runs": speeds, "spread": max(speeds) - min(speeds)}
        snap = Snapshot()
        snap.add("serving rows", "baseline/c1", normalize(row))
        return snap

    assert compare(served([7.4, 7.1], 8), served([4.99, 3.2], 8)).equal
    assert not compare(served([7.4, 7.1], 8), served([7.4, 7.1], 7)).equal
