"""scripts/check_words.py: the word check flags a planted line and a planted file name, and passes a
file that uses the product's own words (an HTTP session, a random seed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # the word check runs as a child process

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_words.py"
# Built from parts, so this file does not trip the check itself.
PLANTED = "measured in " + "sess" + "ion 11 on ho" + "st K"


def check(cwd: Path, *names: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *names], cwd=cwd, capture_output=True, text=True)


def test_a_planted_line_fails_the_check(tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text("first line\n" + PLANTED + "\n")
    done = check(tmp_path, "notes.md")
    assert done.returncode == 1
    assert done.stdout.strip() == f"notes.md:2:{PLANTED}"


# One line per word the check must catch (each built from parts, like PLANTED).
LISTED = [
    "as in " + "sess" + "ion 4",
    "over three " + "sess" + "ions",
    "in the next " + "sess" + "ion",
    "the " + "lea" + "se ran out",
    "in " + "cal" + "l 13",
    "during " + "cal" + "ls 1-3",
    "see " + "iss" + "ue #22",
    "the " + "caps" + "tone run",
    "as " + "the se" + "ed did",
    "def test_" + "the_se" + "eds_loop():",
    "the " + "se" + "ed/" + "loop.txt note",
    "per " + "resea" + "rch/sglang.md",
    "ask the " + "coordi" + "nator",
    "written to " + "$" + "OUT/log",
    "measured on " + "ho" + "st E",
    "on " + "ho" + "sts K and L",
    "extract-" + "ho" + "st-k.json",
]


@pytest.mark.parametrize("line", LISTED)
def test_every_listed_word_fails_the_check(tmp_path: Path, line: str) -> None:
    (tmp_path / "notes.md").write_text(line + "\n")
    assert check(tmp_path, "notes.md").returncode == 1, line


def test_a_planted_file_name_fails_the_check(tmp_path: Path) -> None:
    name = "extract-" + "sess" + "ion4.json"
    (tmp_path / name).write_text("{}\n")
    done = check(tmp_path, name)
    assert done.returncode == 1 and done.stdout.startswith(f"{name}:0:")


def test_the_products_own_words_pass(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text(
        "session = requests.Session()  # one HTTP session per client\n"
        "rng = random.Random(seed)  # the shuffle is a function of its seed alone\n"
        "release the host a lock (host a)\n"
        "the server runs in its own session; a pytest session fixture\n"
        'out=$1; echo done > "$out/log"  # the script names its own output folder\n'
    )
    done = check(tmp_path, "ok.py")
    assert done.returncode == 0, done.stdout
