"""`aerie bundle` and its offline install, for real on this machine.

A bundle of aerie (its wheel built here from this source tree) and two of its requirements with what
they require (pydantic, PyYAML: no torch wheel needed to prove the path) is written in parts of half a
MiB, the parts are copied to another folder as they would be carried to a host, and `install.pyz` from
one part installs it into a fresh folder with pip --no-index. The installed aerie is then imported by
an interpreter that sees nothing but that folder and the standard library (`python -S`). Wheels come from
the local wheelhouse the image builds fill (`~/.cache/aerie/wheelhouse`) when it holds them, else from
pip's index.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aerie.bundle import CONTENTS, MIB
from aerie.bundle.build import BundleRequest, _capacity
from aerie.bundle.cli import skip_list
from aerie.bundle.wheels import expand_platforms, markers, wheel_pins
from aerie.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
PART_MB = 0.5
ONLY = ["pydantic", "pyyaml"]
WHEELHOUSE = Path.home() / ".cache" / "aerie" / "wheelhouse"


def wheel_sources() -> list[str]:
    """`--find-links WHEELHOUSE --no-index` when the wheelhouse holds this pydantic, else pip's index."""
    if list(WHEELHOUSE.glob(f"pydantic-{md.version('pydantic')}-*.whl")):
        return ["--find-links", str(WHEELHOUSE), "--no-index"]
    return []


def run(*cmd: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def without_pythonpath() -> dict[str, str]:
    """This environment less PYTHONPATH: the host's interpreter does not see this checkout."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.mark.integration
def test_a_bundle_installs_offline_and_aerie_imports_from_it(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    printed = run(sys.executable, "-m", "aerie.cli", "bundle", "--out", str(out), "--no-target",
                  "--only", *ONLY, "--max-part-mb", str(PART_MB), *wheel_sources())  # fmt: skip
    parts = sorted(out.glob("part-*"))
    assert len(parts) >= 3, printed  # pydantic-core alone is larger than a part: it is split
    for part in parts:
        assert (part / CONTENTS).is_file() and (part / "install.pyz").is_file()
        assert sum(f.stat().st_size for f in part.rglob("*") if f.is_file()) <= PART_MB * MIB

    # Carried to the host: the parts alone, without the work folder the download left here; the first
    # one late. Until it lands, the install names what it lacks and where that is, and installs nothing.
    host = tmp_path / "host"
    for part in parts[1:]:
        shutil.copytree(part, host / "bundle" / part.name)
    dest = host / "aerie"
    installer = host / "bundle" / parts[-1].name / "install.pyz"
    early = subprocess.run([sys.executable, str(installer), "--into", str(dest)], capture_output=True,
                           text=True, env=without_pythonpath(), cwd=host, timeout=600)  # fmt: skip
    assert early.returncode == 1 and "not unpacked yet" in early.stderr
    assert f"(from {parts[0].name})" in early.stderr and not (dest / "site").exists()
    shutil.copytree(parts[0], host / "bundle" / parts[0].name)
    report = run(sys.executable, str(installer), "--into", str(dest), "--check", "aerie.configbase", "yaml",
                 env=without_pythonpath(), cwd=host)  # fmt: skip
    assert "installed and importable:" in report and "aerie 0.1.0" in report and "pydantic " in report
    again = run(sys.executable, str(installer), "--into", str(dest), "--no-check", env=without_pythonpath())
    assert "already installed" in again

    # The installed aerie holds the data its modules read at run time (the planner's tables...), not
    # only its modules.
    data = [
        f.relative_to(REPO)
        for f in (REPO / "aerie").rglob("*")
        if f.is_file() and f.suffix not in (".py", ".pyc")
    ]
    assert data and all((dest / "site" / f).is_file() for f in data), [
        f for f in data if not (dest / "site" / f).is_file()
    ]

    # Nothing but the installed folder and the standard library: `-S` leaves this venv's packages out.
    probe = "import aerie, aerie.configbase, yaml, pydantic; print(aerie.__file__, yaml.__file__, pydantic.__file__)"
    isolated = {**without_pythonpath(), "PYTHONPATH": str(dest / "site")}
    for module in run(sys.executable, "-S", "-c", probe, env=isolated, cwd=host).split():
        assert Path(module).is_relative_to(dest / "site"), module

    # env.sh gives a shell the same environment, with aerie's script on PATH.
    shell = f'. "{dest}/env.sh" && command -v aerie && "{sys.executable}" -c "import aerie; print(aerie.__file__)"'
    script, module = run("bash", "-c", shell, env=without_pythonpath(), cwd=host).split()
    assert Path(script) == dest / "site" / "bin" / "aerie"
    assert Path(module).is_relative_to(dest / "site")


def test_pins_follow_requirements_less_what_the_host_has() -> None:
    env = markers(f"{sys.version_info.major}.{sys.version_info.minor}", "manylinux_2_28_x86_64")
    pins = wheel_pins(["pydantic"], env)
    assert pins["pydantic"] == md.version("pydantic") and "pydantic-core" in pins
    assert "typing-extensions" in pins
    skipped = wheel_pins(["pydantic"], env, skip=frozenset({"typing_extensions", "pydantic-core"}))
    assert "typing-extensions" not in skipped and "pydantic-core" not in skipped
    kept = wheel_pins(
        ["pydantic"], env, skip=frozenset({"typing-extensions"}), always=frozenset({"typing-extensions"})
    )
    assert "typing-extensions" in kept


def test_skip_from_reads_a_pip_freeze(tmp_path: Path) -> None:
    freeze = tmp_path / "host.txt"
    freeze.write_text(
        "# the host\ntorch==2.9.0+cu130\nnumpy>=2\n-e git+https://example.org/x#egg=x\nPyYAML @ file:///w\n"
    )
    assert skip_list(str(freeze)) == ["torch", "numpy", "PyYAML"]


def test_a_part_too_small_for_the_installer_is_refused(tmp_path: Path) -> None:
    installer = tmp_path / "install.pyz"
    installer.write_bytes(b"x" * 100_000)
    with pytest.raises(ConfigError, match="--max-part-mb 0.05"):
        _capacity(BundleRequest(out=tmp_path, max_part_mb=0.05), [installer])
    assert _capacity(BundleRequest(out=tmp_path, max_part_mb=1), [installer]) < MIB


@pytest.mark.integration
def test_a_hugging_face_target_travels_as_the_cache_holds_it(tmp_path: Path) -> None:
    """A target named by its Hugging Face id goes as the hub's cache holds it (a snapshot and its ref),
    and on the host the same offline lookup aerie makes (`snapshot_download(local_files_only=True)`)
    finds it in the installed folder. The cache here is made by hand: no model is downloaded."""
    from aerie.bundle import InstallDir, environ, unpack
    from aerie.bundle.build import BundleRequest, build_bundle

    cache = tmp_path / "hf-here"
    snapshot = cache / "models--acme--tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')
    (snapshot / "tokenizer.json").write_text("{}")
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("0123abcd")

    out, dest = tmp_path / "bundle", InstallDir(tmp_path / "host")
    here = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in here.items():
            mp.setenv(key, value)
        # huggingface_hub reads both at its import, which another test in this process may have made.
        mp.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
        mp.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
        index = build_bundle(
            BundleRequest(out=out, overrides=["target.name=acme/tiny"], wheels=False, aerie=False)
        )
    assert {e["path"] for e in index["files"]} == {
        "hf/hub/models--acme--tiny/refs/main",
        "hf/hub/models--acme--tiny/snapshots/0123abcd/config.json",
        "hf/hub/models--acme--tiny/snapshots/0123abcd/tokenizer.json",
    }
    assert not unpack(out / "part-1", dest).missing

    probe = "from huggingface_hub import snapshot_download as s; print(s('acme/tiny', local_files_only=True))"
    env = environ(dest, base={k: v for k, v in os.environ.items() if not k.startswith("HF_")})
    found = Path(run(sys.executable, "-c", probe, env=env, cwd=tmp_path).strip())
    assert found == dest.staged / "hf" / "hub" / "models--acme--tiny" / "snapshots" / "0123abcd"
    assert (found / "config.json").read_text() == '{"model_type": "llama"}'


def test_a_manylinux_tag_takes_the_older_glibc_tags_it_runs() -> None:
    tags = expand_platforms(["manylinux_2_28_x86_64", "macosx_14_0_arm64"])
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags and tags[-1] == "macosx_14_0_arm64"
