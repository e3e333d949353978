"""`aerie.diskspace.writing` against a real full device: Linux's /dev/full refuses every write with
ENOSPC, exactly as a full disk does."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

from aerie.diskspace import existing_parent, free_text, writing
from aerie.errors import DataError, TrainingError

FULL = Path("/dev/full")


@pytest.mark.skipif(not FULL.exists(), reason="/dev/full is Linux's")
def test_a_write_to_a_full_device_becomes_the_stages_error_naming_it() -> None:
    with pytest.raises(DataError) as caught, writing(FULL, DataError), open(FULL, "w") as f:
        f.write("x" * 10)
        f.flush()
    message = str(caught.value)
    assert message.startswith("cannot write /dev/full (") and "free there" in message
    assert "No space left on device" in message
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.ENOSPC


def test_aeries_own_errors_pass_through_unchanged(tmp_path) -> None:
    original = TrainingError("already said")
    with pytest.raises(TrainingError) as caught, writing(tmp_path / "f", DataError):
        raise original
    assert caught.value is original


def test_the_room_left_is_that_of_the_nearest_existing_folder(tmp_path) -> None:
    # A file about to be written in folders not made yet: its filesystem is the nearest existing one's.
    assert existing_parent(tmp_path / "not" / "yet" / "there.bin") == tmp_path.resolve()
    assert re.fullmatch(r"\d+\.\d\d GiB free there", free_text(tmp_path / "not" / "yet" / "there.bin"))
