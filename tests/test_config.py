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
    flags = apply_overrides(base, ["server.extra_args=[--max-running-requests,65536,--cuda-graphs]"])
    assert flags.server.extra_args == ["--max-running-requests", "65536", "--cuda-graphs"]


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
    ("override", "names"),
    [
        ("server.port.x=1", ["server.port is an integer, it has no field 'x'"]),
        ("server.host.x.y=1", ["server.host is a string, it has no field 'x'"]),
        ("generate.datasets.5.num_samples=1", ["generate.datasets has 1 element(s), there is no index 5"]),
        ("generate.datasets.x.num_samples=1", ["generate.datasets is a list, 'x' is not an index (0..0)"]),
        ("server.portt=1", ["server.portt", "unknown field; allowed: backend, launcher", "port"]),
        ("generate.datasets.0.nmu=1", ["generate.datasets.0.nmu", "allowed: name, source, num_samples"]),
    ],
)
def test_override_paths_name_the_type_or_the_allowed_fields(override, names):
    with pytest.raises(ConfigError) as info:
        apply_overrides(get_preset("smollm2-local"), [override])
    for text in names:
        assert text in str(info.value)
    assert "no such list element" not in str(info.value)


def test_overrides_still_reach_mappings_and_unset_sections():
    cfg = apply_overrides(
        get_preset("smollm2-local"),
        [
            "server.env.FOO=bar",
            "generate.endpoint.provider.order=[a,b]",
            "corpus.chat_template_kwargs.x=true",
        ],
    )
    assert cfg.server.env == {"FOO": "bar"} and cfg.generate.endpoint.provider == {"order": ["a", "b"]}
    assert cfg.corpus.chat_template_kwargs == {"x": True}


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (
            ["train.batch_tokens=16", "train.drafter.ttt_length=20"],
            ["train.batch_tokens 16 must be at least train.drafter.ttt_length + 2 = 22"],
        ),
        # EAGLE-3's own settings moved into its section: the old key names the new one.
        (["train.ttt_length=3"], ["train.ttt_length -> train.drafter.ttt_length"]),
        (
            ["train.recompute=true", "train.draft_vocab_size=64"],
            [
                "train.draft_vocab_size -> train.drafter.draft_vocab_size",
                "train.recompute -> train.drafter.recompute",
            ],
        ),
        (["evaluate.num_steps=[]"], ["evaluate.num_steps", "at least 1 item"]),
        (["evaluate.num_steps=[3,0]"], ["evaluate.num_steps.1", "greater than or equal to 1"]),
        (["evaluate.proposers=[]"], ["evaluate.proposers", "at least 1 item"]),
        (
            ["generate.datasets=[{name: a, source: {kind: sharegpt}}, {name: a, source: {kind: mtbench}}]"],
            ["dataset names must be unique", "['a'] twice"],
        ),
        (
            ["generate.datasets=[{name: mine, source: {kind: jsonl}}]"],
            ["generate.datasets.0", "'jsonl' reads a file, so source.path is required"],
        ),
        (
            ["server.launcher=docker"],
            ["server.launcher 'docker' runs SGLang, not server.backend 'reference'"],
        ),
        (["deploy.eagle_topk=2"], ["deploy.eagle_topk 2 drafts trees", "server.backend is 'reference'"]),
    ],
)
def test_checks_that_need_only_the_config_run_at_load(overrides, names):
    with pytest.raises(ConfigError) as info:
        apply_overrides(get_preset("smollm2-local"), overrides)
    for text in names:
        assert text in str(info.value)


@pytest.mark.parametrize(
    ("override", "names"),
    [
        (
            "server.extra_args=[--max-batch-tokens,65536]",
            ["server.extra_args gives --max-batch-tokens", "extract.batch_tokens"],
        ),
        ("server.extra_args=[--port=31000]", ["server.extra_args gives --port", "server.port"]),
        ("server.extra_args=[--tp-size,4]", ["--tp-size", "server.tp_size"]),
        ("server.extra_args=[--speculative-num-steps,5]", ["--speculative-num-steps", "deploy.num_steps"]),
        (
            "generate.endpoint.launch_args=[--device,cuda]",
            ["generate.endpoint.launch_args gives --device", "server.device"],
        ),
    ],
)
def test_a_flag_aerie_sets_from_a_field_is_refused_in_the_extra_args(override, names):
    with pytest.raises(ConfigError) as info:
        apply_overrides(get_preset("smollm2-local"), [override])
    for text in names:
        assert text in str(info.value)


def test_flags_aerie_does_not_set_pass_and_launch_args_may_size_the_generation_server():
    cfg = apply_overrides(
        get_preset("smollm2-local"),
        [
            "server.extra_args=[--max-running-requests,5]",
            "generate.endpoint.launch_args=[--max-batch-tokens,4096]",
        ],
    )
    assert cfg.generate.endpoint.launch_args == ["--max-batch-tokens", "4096"]


def test_sglang_generation_refuses_the_reference_servers_cuda_graphs_flag():
    # The GPU preset generates with the reference server's --cuda-graphs; with SGLang the generation
    # server is SGLang's, which has no such flag.
    overrides = ["server.backend=sglang", "extract.quantize_on_server=false"]
    with pytest.raises(ConfigError, match=r"reference server's --cuda-graphs.*launch_args=\[\]"):
        apply_overrides(get_preset("smollm2-gpu"), overrides)
    cfg = apply_overrides(get_preset("smollm2-gpu"), [*overrides, "generate.endpoint.launch_args=[]"])
    assert cfg.server.backend == "sglang" and cfg.generate.endpoint.launch_args == []


def test_overrides_are_taken_before_between_and_after_options():
    from aerie.cli import parse_args

    args = parse_args(["run", "smollm2-local", "a=1", "--no-prefect", "b=2", "--until", "merge", "c=3"])
    assert args.overrides == ["a=1", "b=2", "c=3"] and args.no_prefect and args.until == "merge"
    with pytest.raises(SystemExit):
        parse_args(["run", "smollm2-local", "--no-prefect", "--bogus"])
    with pytest.raises(SystemExit):
        parse_args(["presets", "train.epochs=2"])
