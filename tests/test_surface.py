"""The public surface: `aerie.__all__` is the curated list, the wheel installs the flows and the
deployments under `aerie`, and a stage without a Prefect policy gets the default one."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import aerie
from flows.policy import default_policy
from flows.stage import POLICIES, policy_of

ROOT = Path(__file__).resolve().parents[1]

PUBLIC = [
    "AerieError", "ConfigError", "Family", "PipelineConfig", "PipelineReport", "Stage", "StageContext",
    "StageResult", "Upstream", "__version__", "apply_overrides", "get_preset", "load_config", "open_store",
    "register_family", "resolve_target", "run_pipeline",
]  # fmt: skip


def test_aerie_exports_exactly_the_curated_names() -> None:
    assert sorted(aerie.__all__) == sorted(PUBLIC)
    for name in aerie.__all__:
        assert getattr(aerie, name) is not None, name


@pytest.mark.integration  # a fresh interpreter: the import is measured in a child process
def test_import_aerie_stays_light() -> None:
    code = "import sys, aerie; print(sorted(m for m in ('pydantic', 'torch', 'aerie.config') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "[]"


def test_the_wheel_lists_every_package_under_aerie() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "aerie").rglob("__init__.py")}
    mapped = {f"aerie.{name}" for name in ("flows", "deployments")}
    assert set(tool["packages"]) == found | mapped
    assert tool["package-dir"] == {f"aerie.{name}": name for name in ("flows", "deployments")}


def test_flows_and_deployments_import_each_other_relatively() -> None:
    absolute = []
    for folder in ("flows", "deployments"):
        for path in (ROOT / folder).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.ImportFrom)
                    and node.level == 0
                    and (node.module or "").split(".")[0] == folder
                    or isinstance(node, ast.Import)
                    and any(a.name.split(".")[0] == folder for a in node.names)
                ):
                    absolute.append(f"{path.name}:{node.lineno}")
    assert not absolute, absolute


def test_a_stage_without_a_policy_gets_the_default() -> None:
    assert policy_of("merge") is POLICIES["merge"]
    policy = policy_of("new-stage")
    assert policy == default_policy("new-stage") or policy.task == "new-stage"
    assert (policy.task, policy.retries, policy.report) == ("new-stage", 0, None)


def test_every_export_has_its_module() -> None:
    assert sorted(aerie.__all__) == sorted(["__version__", *aerie._EXPORTS])
