"""A YAML config that gives one key twice is refused, naming the key and both lines (plain YAML keeps
the later value silently)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aerie.config import load_yaml
from aerie.errors import ConfigError


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("run: first\ntrain:\n  epochs: 2\n  epochs: 3\n")
    with pytest.raises(ConfigError, match=r"key 'epochs' is given twice: lines 3 and 4"):
        load_yaml(path)


def test_the_same_key_in_two_sections_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("run: first\ntrain:\n  epochs: 2\n")
    assert load_yaml(path).train.epochs == 2


def test_an_empty_store_uri_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("store:\n  uri: ''\n")
    with pytest.raises(ConfigError, match=r"store.uri"):
        load_yaml(path)
