"""Printed outputs in the docs, regenerated from the code: a fenced block right after a comment naming
the command that prints it

    <!-- output: aerie plan kimi-k2.5-8gpu -->
    ```
    ...what the command prints...
    ```

is that command's output today.

    python scripts/doc_outputs.py            # check: exit 1 naming each block that differs
    python scripts/doc_outputs.py --write    # rewrite the blocks from the commands

`aerie` runs as this interpreter's `python -m aerie.cli`. What depends on the machine rather than the code
(the free space of a local filesystem, what the plan concludes from it, the home directory) is compared
as a placeholder or left out, so the check holds on any machine.
"""

from __future__ import annotations

import difflib
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ["README.md", "benchmarks/README.md", "docs/*.md"]
BLOCK = re.compile(r"(<!-- output: (?P<cmd>.+?) -->\n```[^\n]*\n)(?P<body>.*?)(```)", re.S)
MACHINE = [
    (re.compile(r"[\d.,]+ [KMGT]?B free"), "<free> free"),
    (re.compile(r"(/root|/home/[^/\s]+|/Users/[^/\s]+)(?=/)"), "~"),  # the home directory
    # What is concluded from that free space: a disk marked SHORT, and the refusal (and error line) it brings.
    (re.compile(r"  SHORT$", re.M), ""),
    (re.compile(r"^  - NotEnoughDiskError: .*\n", re.M), ""),
    (re.compile(r"^aerie: error: not enough disk for this run.*\n?", re.M), ""),
    (re.compile(r"\n\ncannot fit\n(?!  - )"), "\n"),  # the heading, once no refusal is left under it
]


def run(command: str) -> str:
    """What `command` prints (stdout and stderr), from the repository's root."""
    argv = shlex.split(command)
    if argv[0] == "aerie":
        argv = [sys.executable, "-m", "aerie.cli", *argv[1:]]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 2):  # 2: a plan that refuses, which a doc may show
        raise SystemExit(f"`{command}` exited {done.returncode}:\n{done.stderr}")
    return done.stdout + done.stderr


def machine_free(text: str) -> str:
    for pattern, placeholder in MACHINE:
        text = pattern.sub(placeholder, text)
    return text


def files(names: list[str]) -> list[Path]:
    out: list[Path] = []
    for name in names:
        out += sorted(ROOT.glob(name)) if "*" in name else [ROOT / name]
    return out


def main(argv: list[str]) -> int:
    write = "--write" in argv
    names = [a for a in argv if a != "--write"] or FILES
    differ = 0
    for path in files(names):
        text = path.read_text()
        pieces, last = [], 0
        for block in BLOCK.finditer(text):
            printed = run(block["cmd"])
            if machine_free(printed) != machine_free(block["body"]):
                differ += 1
                rel = path.relative_to(ROOT)
                line = text.count("\n", 0, block.start()) + 1
                diff = difflib.unified_diff(
                    block["body"].splitlines(), printed.splitlines(), "doc", "today", lineterm="", n=1
                )
                print(f"{rel}:{line}: `{block['cmd']}` prints something else today:")
                print("\n".join(diff))
            pieces += [text[last : block.start("body")], printed]
            last = block.end("body")
        if write:
            path.write_text("".join(pieces) + text[last:])
    return 1 if differ and not write else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
