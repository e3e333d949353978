"""A YAML config that gives one key twice is refused, naming the key and both lines (plain YAML keeps
the later value silently)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aerie.config import load_yaml
from aerie.errors import ConfigError
from aerie.presets import load_config

ONE_DATASET = "generate:\n  datasets:\n    - name: chat\n      source: {kind: sharegpt}\n"


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("run: first\ntrain:\n  epochs: 2\n  epochs: 3\n")
    with pytest.raises(ConfigError, match=r"key 'epochs' is given twice: lines 3 and 4"):
        load_yaml(path)


def test_the_same_key_in_two_sections_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(f"run: first\n{ONE_DATASET}train:\n  epochs: 2\n")
    assert load_yaml(path).train.epochs == 2


def test_an_empty_store_uri_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("store:\n  uri: ''\n")
    with pytest.raises(ConfigError, match=r"store.uri"):
        load_yaml(path)


def test_an_empty_dataset_list_is_named_at_load(tmp_path: Path) -> None:
    """Not found by the merge, after the stages before it, as having nothing to read."""
    with pytest.raises(ConfigError, match=r"generate.datasets: the list is empty"):
        load_config("smollm2-local", ["generate.datasets=[]"])
    path = tmp_path / "run.yaml"
    path.write_text("run: first\n")  # no generate section at all: the same
    with pytest.raises(ConfigError, match=r"generate.datasets: the list is empty"):
        load_yaml(path)
    path.write_text(f"run: first\n{ONE_DATASET}")
    assert [spec.name for spec in load_yaml(path).generate.datasets] == ["chat"]
