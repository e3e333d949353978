"""Refused writes, reported alike by every stage: what could not be written and how much room is left on
that filesystem (a full disk is the usual cause), raised as the stage's own error with the low-level
one as its cause."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from aerie.errors import AerieError


def existing_parent(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (where a file about to be written will live)."""
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_text(path: Path) -> str:
    """'N.NN GiB free there' for the filesystem that holds (or will hold) `path`."""
    try:
        return f"{shutil.disk_usage(existing_parent(path)).free / 2**30:.2f} GiB free there"
    except OSError as exc:
        return f"free space unknown: {exc}"


def cannot_write(path: Path, exc: BaseException, what: str = "") -> str:
    """The message of a refused write: the file (`what` it is, if given), the room left on its
    filesystem, the cause."""
    return f"cannot write {what + ' ' if what else ''}{path} ({free_text(path)}): {exc}"


@contextlib.contextmanager
def writing(path: Path, error: type[AerieError]) -> Iterator[None]:
    """Around code that writes `path`: any failure but aerie's own becomes `error`, naming the path and
    the room left. Only for code that does nothing but write, so that the message cannot mislead."""
    try:
        yield
    except AerieError:
        raise
    except Exception as exc:
        raise error(cannot_write(path, exc)) from exc
