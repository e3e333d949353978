"""The word check: tracked files describe aerie and its users' world, not how aerie was built.

    python scripts/check_words.py            # every file `git ls-files` lists
    python scripts/check_words.py FILE...    # only these files

Prints `file:line:text` for each line (and `file:0:name` for each file name) that uses one of the
words of a development log: a numbered work session, a machine lease, a numbered tool call, a
lettered test host, an issue number, the project's milestone name or its starting code. Exits 1 if
any, 0 otherwise. Words the product uses in its own world (an HTTP session, `requests.Session`, a
random seed) do not match: each pattern below is precise.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Case-insensitive patterns.
PATTERNS = [
    r"\bsession[ _-]?\d",  # a numbered session, with or without a separator
    r"\bsessions\b",
    r"\b(this|that|next|earlier|previous|later|last) session\b",  # not a process's or an HTTP session
    r"\bleases?\b",
    r"\bcalls?[ _-]?#?\d",  # a numbered call, with or without a space or #
    r"\bissues?[ _-]?#?\d",  # a numbered issue, likewise
    r"capstone",
    r"(?<![a-z])the[ _]seeds?(?![a-z])",  # the starting code (also in names); a random seed is "its seed"
    r"\b(seed|research)/",  # the starting code's and the research notes' folders
    r"\bcoordinator\b",
]
# Case-sensitive patterns.
EXACT = [
    # A lettered host: the word in any case, then one capital A-L (a lower-case letter in prose does not
    # trip); in a name, the word joined to a lower-case letter by a dash or an underscore.
    r"\b[Hh][Oo][Ss][Tt][Ss]?[ _-][A-L]\b",
    r"\bhost[-_][a-l]\b",
    r"\$OUT\b",  # one test machine's output folder (a script's own `$out` is fine)
]
WORDS = re.compile("|".join([*(f"(?i:{p})" for p in PATTERNS), *EXACT]))

# The check's own source names the words it looks for.
ALLOWED = ["scripts/check_words.py"]


def hits(name: str, text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) for each line of `text` that uses a listed word; line 0 is the file's name."""
    if WORDS.search(name):
        yield 0, name
    for number, line in enumerate(text.splitlines(), start=1):
        if WORDS.search(line):
            yield number, line.strip()


def tracked_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True)
    return [name for name in out.stdout.decode().split("\0") if name]


def read_text(path: Path) -> str:
    """The file's text; a binary file (or one git lists but the tree lacks) is checked by name only."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return ""
    if b"\0" in data[:8192]:
        return ""
    return data.decode("utf-8", errors="replace")


def check(root: Path, names: Iterable[str]) -> list[str]:
    """One `file:line:text` entry per hit in the named files (paths relative to `root`)."""
    found = []
    for name in names:
        if any(fnmatch.fnmatch(name, glob) for glob in ALLOWED):
            continue
        for number, line in hits(name, read_text(root / name)):
            found.append(f"{name}:{number}:{line}")
    return found


def main(argv: list[str]) -> int:
    names = argv or tracked_files(ROOT)
    found = check(ROOT if not argv else Path.cwd(), names)
    for entry in found:
        print(entry)
    if found:
        print(f"check_words: {len(found)} line(s) speak of how aerie was built", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
