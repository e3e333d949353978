from __future__ import annotations

import pytest

from aerie.cli import main
from aerie.config import apply_overrides, load_yaml, to_yaml
from aerie.errors import ConfigError
from aerie.presets import PRESETS, get_preset


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_validate_and_round_trip_through_yaml(name, tmp_path):
    cfg = get_preset(name)
    path = tmp_path / "c.yaml"
    path.write_text(to_yaml(cfg))
    assert load_yaml(path) == cfg


def test_overrides_change_only_what_they_name():
    base = get_preset("smollm2-local")
    cfg = apply_overrides(
        base, ["train.epochs=2", "evaluate.num_steps=[3]", "generate.datasets.0.num_samples=5"]
    )
    assert (cfg.train.epochs, cfg.evaluate.num_steps, cfg.generate.datasets[0].num_samples) == (2, [3], 5)
    assert cfg.train.lr == base.train.lr
    # Flags with numbers, as typed on a command line (YAML reads 65536 as an int; the field wants str).
    flags = apply_overrides(base, ["server.extra_args=[--max-batch-tokens,65536,--cuda-graphs]"])
    assert flags.server.extra_args == ["--max-batch-tokens", "65536", "--cuda-graphs"]


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("train.epochz=2", ["train.epochz", "unknown field"]),
        ("server.launcher=k8s", ["server.launcher", "'process' or 'docker'"]),
        ("train.lr=-1", ["train.lr", "greater than 0"]),
        ("no_equals_sign", ["key=value"]),
    ],
)
def test_bad_overrides_name_the_field_and_allowed_values(override, names):
    with pytest.raises(ConfigError) as info:
        apply_overrides(get_preset("smollm2-local"), [override])
    for text in names:
        assert text in str(info.value)


def test_unknown_preset_lists_the_allowed_ones(capsys):
    assert main(["config", "show", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'nope'" in err and "smollm2-local" in err


def test_cli_shows_a_preset_with_overrides(capsys):
    assert main(["config", "show", "smollm2-local", "train.epochs=3"]) == 0
    assert "epochs: 3.0" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("server.port.x=1", "server.port is an integer (30000), it has no field 'x'"),
        ("generate.datasets.3.name=a", "generate.datasets has 1 element(s): no element 3"),
        ("generate.datasets.x.name=a", "generate.datasets is a list: 'x' is not an index (0..0)"),
        ("train.epochz=2", "allowed: attention, batch_tokens"),
    ],
)
def test_a_bad_nested_path_says_what_is_there(override, message):
    with pytest.raises(ConfigError) as info:
        apply_overrides(get_preset("smollm2-local"), [override])
    assert message in str(info.value)


def test_overrides_are_taken_before_between_and_after_options():
    from aerie.cli import parse_args

    args = parse_args(["run", "smollm2-local", "a=1", "--no-prefect", "b=2", "--until", "merge", "c=3"])
    assert args.overrides == ["a=1", "b=2", "c=3"] and args.no_prefect and args.until == "merge"
    with pytest.raises(SystemExit):
        parse_args(["run", "smollm2-local", "--no-prefect", "--bogus"])
    with pytest.raises(SystemExit):
        parse_args(["presets", "train.epochs=2"])
