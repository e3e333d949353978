"""Drafter families are plug-ins: a toy family (tests/toy_family.py) registered the way
`docs/extending.md` says reaches the config, extraction, the planner, the evaluator, the deploy check
through the registry alone (the reference server serving it as a plug-in: tests/test_toy_family.py), and
nothing outside `aerie/families/` branches on a family's name."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from aerie.config import PipelineConfig, apply_overrides
from aerie.errors import ConfigError
from aerie.families import Family, family, family_of, names, register, serving, spread_layers
from aerie.families import unregister as unregister_family
from aerie.presets import load_config
from aerie.serving import SpeculativeArgs
from tests.toy_family import TOY, ToyDrafter, ToyProposer, ToySettings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def toy() -> Iterator[Family]:
    register(TOY)
    yield TOY
    unregister_family(TOY.name)


TOY_RUN = ["train.drafter=toy", "train.drafter.num_target_layers=3", "deploy.enabled=false"]


def test_a_registered_family_is_a_config_choice_with_its_own_settings(toy: Family) -> None:
    cfg = load_config("smollm2-local", TOY_RUN)
    assert isinstance(cfg.train.drafter, ToySettings)
    assert family_of(cfg.train.drafter) is toy and "toy" in names()
    assert cfg.train.capture_layers(30) == spread_layers(30, 3)
    # The section round-trips through a dump (Prefect parameters, the torchrun workers' spec).
    again = PipelineConfig.model_validate(cfg.model_dump(mode="json"))
    assert again.train.drafter == cfg.train.drafter
    with pytest.raises(ConfigError, match=r"train.drafter: toy: block_size: not a toy setting"):
        load_config("smollm2-local", [*TOY_RUN, "train.drafter.block_size=4"])


def test_what_a_family_cannot_do_fails_when_the_config_loads(toy: Family) -> None:
    with pytest.raises(ConfigError, match="the deploy stage does not serve toy drafters"):
        load_config("smollm2-local", ["train.drafter=toy"])
    with pytest.raises(ConfigError, match="the deploy stage does not serve dflash drafters"):
        load_config("smollm2-local", ["train.drafter=dflash"])
    with pytest.raises(ConfigError, match="unknown drafter family 'medusa'; allowed: eagle3, dflash, toy"):
        load_config("smollm2-local", ["train.drafter=medusa"])
    with pytest.raises(ConfigError, match="registered already"):
        register(Family(**{**TOY.__dict__, "served_algorithm": "OTHER"}))
    assert isinstance(family("toy").config.model_validate({}), ToySettings)


def test_the_stages_reach_the_family_through_the_registry(toy: Family, smollm2) -> None:
    from aerie.evaluate.stage import evaluate_config
    from aerie.evaluate.work import make_proposer
    from aerie.extract.stage import extract_config
    from aerie.plan.disk import drafter_params
    from aerie.plan.facts import target_facts

    cfg = load_config("smollm2-local", TOY_RUN)
    # Extraction captures what the toy reads; the evaluator measures the toy where the default is listed.
    assert extract_config(cfg, smollm2).capture_layers == spread_layers(smollm2.geometry.num_layers, 3)
    ev = evaluate_config(cfg)
    assert ev.proposers == ["toy", "prompt_lookup"]
    drafter = ToyDrafter()
    proposer, aux_layers = make_proposer("toy", ev, {"drafter": drafter, "family": toy})
    assert isinstance(proposer, ToyProposer) and proposer.drafter is drafter and aux_layers is None
    facts = target_facts(cfg.target)
    assert drafter_params(cfg, facts) == 3 * facts.geometry.hidden_size**2
    assert family("toy").model.load() is ToyDrafter


def test_the_planner_counts_the_familys_flops(toy: Family) -> None:
    """A family without its own FLOP count trains as a dense forward and backward over its parameters;
    EAGLE-3's count (its TTT steps) is its own and stays out of other families' plans."""
    from aerie.plan.facts import hardware, target_facts
    from aerie.plan.throughput import Model, draft_flops

    cfg = load_config("smollm2-local", TOY_RUN)
    facts = target_facts(cfg.target)
    model = Model(cfg, facts, hardware("h100"))
    assert draft_flops(model, 512) == 6 * 3 * facts.geometry.hidden_size**2
    eagle = load_config("smollm2-local", [])
    longer = apply_overrides(eagle, [f"train.drafter.ttt_length={2 * eagle.train.drafter.ttt_length}"])
    assert draft_flops(Model(longer, facts, hardware("h100")), 512) > draft_flops(
        Model(eagle, facts, hardware("h100")), 512
    )


def test_serving_takes_the_familys_algorithm(toy: Family) -> None:
    assert serving("TOY") is toy and SpeculativeArgs("/d", algorithm="TOY").to_args()[:2] == [
        "--speculative-algorithm",
        "TOY",
    ]
    with pytest.raises(ConfigError, match="no drafter family is served as 'MEDUSA'"):
        SpeculativeArgs("/d", algorithm="MEDUSA")


# -- no branches on family names outside the registry -------------------------------------------------


def _family_names_branched_on(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, name) of every family name compared against, matched on, indexed by or listed in a
    `Literal[...]`: the places a new family would need an edit."""
    known = set(names())

    def literals(node: ast.AST) -> Iterator[str]:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Constant) and sub.value in known:
                yield sub.value

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
        elif isinstance(node, ast.match_case):
            parts = [node.pattern]
        elif isinstance(node, ast.Subscript) and (
            isinstance(node.value, ast.Name)
            and node.value.id == "Literal"
            or isinstance(node.slice, ast.Constant)
        ):
            parts = [node.slice]
        else:
            continue
        for part in parts:
            for name in literals(part):
                yield part.lineno, name


def test_no_family_name_is_branched_on_outside_the_registry() -> None:
    found = []
    for folder in ("aerie", "flows", "deployments"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.is_relative_to(ROOT / "aerie" / "families"):
                continue
            tree = ast.parse(path.read_text(), str(path))
            found += [
                f"{path.relative_to(ROOT)}:{line}: {name!r}" for line, name in _family_names_branched_on(tree)
            ]
    assert not found, "family names branched on outside aerie/families (use the registry):\n" + "\n".join(
        found
    )


def test_the_scan_sees_each_kind_of_branch() -> None:
    code = (
        "if cfg.drafter == 'dflash': pass\n"
        "x = 'eagle3' in names\n"
        "runs['dflash']\n"
        "Name = Literal['eagle3', 'other']\n"
        "match f:\n    case 'dflash': pass\n"
        "ok = 'dflash'\n"
    )
    lines = sorted({line for line, _ in _family_names_branched_on(ast.parse(code))})
    assert lines == [1, 2, 3, 4, 6]
