"""One SGLang version: envs/sglang/VERSION (read by `make setup-sglang`) is the version the dump plugin
accepts, the tag the extraction image is built FROM and the version sglang's own pin in the lock names."""

from __future__ import annotations

import re
from pathlib import Path

from aerie.sglang_plugin.compat import SUPPORTED_SGLANG

REPO = Path(__file__).resolve().parent.parent
VERSION = (REPO / "envs" / "sglang" / "VERSION").read_text().strip()


def test_the_plugin_accepts_the_environment_version() -> None:
    assert SUPPORTED_SGLANG == (VERSION,)


def test_the_extraction_image_is_built_from_the_same_version() -> None:
    dockerfile = (REPO / "docker" / "sglang-extract.Dockerfile").read_text()
    assert re.findall(r"^FROM lmsysorg/sglang:v(\S+)$", dockerfile, flags=re.M) == [VERSION]


def test_the_lock_pins_exactly_and_holds_no_torch() -> None:
    lines = [
        line
        for line in (REPO / "envs" / "sglang" / "requirements.lock").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==\S+", line) for line in lines)
    names = {line.split("==")[0].lower() for line in lines}
    # torch comes from the machine's CPU build and sglang is installed on its own (--no-deps).
    assert not names & {"torch", "torchvision", "torchaudio", "sglang", "sglang-kernel"}
