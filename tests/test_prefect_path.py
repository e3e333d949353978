"""The Prefect path's surfaces that need no server: prefect.yaml's deployment names, the files
.env.example names, the headline table's rows, and the filter that shows a traceback once. The server,
the worker, the alert and the artifacts on a flow run are tested in tests/test_pipeline.py."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import yaml

from aerie.manifest import StageResult
from flows.headline import headline_rows, headline_text
from flows.reporting import ShowEachTracebackOnce

REPO = Path(__file__).resolve().parents[1]


def test_each_deployment_name_is_unique_so_deploy_name_picks_one():
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    names = [d["name"] for d in deployments]
    assert len(names) == len(set(names)), names


def test_env_example_names_only_files_that_exist():
    text = (REPO / ".env.example").read_text()
    named = set(re.findall(r"\b(?:[\w.-]+/)+[\w.-]+\.(?:py|yaml|md|sh|json)\b", text))
    assert [n for n in named if not (REPO / n).is_file()] == []


def _result(stage: str, figures: dict) -> StageResult:
    return StageResult(
        stage=stage,
        key="k",
        prefix=f"r/{stage}/k",
        manifest_uri="m",
        manifest_sha256="s",
        cache_hit=False,
        seconds=1.0,
        figures=figures,
    )


def test_headline_rows_set_the_drafter_against_prompt_lookup_at_the_longest_chain():
    evaluation = _result(
        "evaluate",
        {
            "accept_mtbench_eagle3_k1": 1.5,
            "accept_mtbench_prompt_lookup_k1": 1.1,
            "accept_mtbench_eagle3_k3": 2.25,
            "accept_mtbench_prompt_lookup_k3": 1.125,
            "accept_mtbench_eagle3_k3_t1": 2.0,  # sampled: not a headline
            "outputs_identical": "4/4",
        },
    )
    deployment = _result(
        "deploy",
        {
            "promoted": True,
            "speedup": 1.5,
            "spec_tok_s_c1": 30.0,
            "base_tok_s_c1": 20.0,
            "same_outputs": "2/2",
        },
    )
    rows = headline_rows([evaluation, deployment])
    assert rows == [
        {
            "figure": "accept length, mtbench, eagle3, 3 draft steps",
            "value": 2.25,
            "against": "prompt lookup 1.125",
        },
        {
            "figure": "served speed-up at concurrency 1",
            "value": "1.50x",
            "against": "30.0 against 20.0 tokens/s without the drafter",
        },
        {"figure": "promoted", "value": "yes", "against": "speed-up 1.5x at the deciding level"},
    ]
    assert (
        headline_text([evaluation])
        == "accept length, mtbench, eagle3, 3 draft steps 2.25 (prompt lookup 1.125); "
        "served not measured (no deploy stage in this run)"
    )


def test_a_traceback_is_shown_once_however_many_levels_log_it():
    logger = logging.getLogger("aerie.test.traceback-once")
    logger.propagate = False
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.addFilter(ShowEachTracebackOnce())
    try:
        raise ValueError("bad input")
    except ValueError:
        for level in ("task", "subflow", "flow"):
            logger.error("%s failed", level, exc_info=True)
    try:
        raise KeyError("another")
    except KeyError:
        logger.error("another failure", exc_info=True)
    assert [r.exc_info is not None for r in records] == [True, False, False, True]
    assert [r.getMessage() for r in records] == [
        "task failed",
        "subflow failed",
        "flow failed",
        "another failure",
    ]
