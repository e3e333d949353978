"""aerie's image recipes: the GPU extraction image (FROM lmsysorg/sglang) and the CPU one (FROM aerie's base)
install the same plugin files, and the built CPU image holds exactly those under /opt/aerie."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

from tests.docker_support import SGLANG_CPU_IMAGE, engine, require_image

REPO = Path(__file__).resolve().parents[1]
GPU_RECIPE = REPO / "docker" / "sglang-extract.Dockerfile"
CPU_RECIPE = REPO / "docker" / "sglang-cpu.Dockerfile"
PLUGIN_ROOT = "/opt/aerie"


def copies(recipe: Path) -> list[tuple[list[str], str]]:
    """Every COPY of a recipe (no --from: files of the build context) as (sources, destination)."""
    found = []
    for line in recipe.read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            *sources, dest = shlex.split(line)[1:]
            found.append((sources, dest))
    return found


def installed_files(recipe: Path, under: str) -> dict[str, str]:
    """Destination path -> repository path of each file a recipe's COPY lines put under `under` (as the
    build context gives them: no __pycache__)."""
    files: dict[str, str] = {}
    for sources, dest in copies(recipe):
        for source in sources:
            local = REPO / source
            if local.is_dir():
                for f in sorted(local.rglob("*")):
                    if f.is_file() and "__pycache__" not in f.parts:
                        files[f"{dest.rstrip('/')}/{f.relative_to(local)}"] = str(f.relative_to(REPO))
            else:
                target = f"{dest.rstrip('/')}/{local.name}" if dest.endswith("/") else dest
                files[target] = source
    return {d: s for d, s in files.items() if d.startswith(under + "/")}


def plugin_layer(recipe: Path) -> list[str]:
    text = recipe.read_text()
    return text.split("# plugin layer: begin\n", 1)[1].split("# plugin layer: end\n", 1)[0].splitlines()


def test_the_gpu_and_cpu_recipes_install_the_same_plugin_files() -> None:
    gpu, cpu = installed_files(GPU_RECIPE, PLUGIN_ROOT), installed_files(CPU_RECIPE, PLUGIN_ROOT)
    assert gpu == cpu
    assert f"{PLUGIN_ROOT}/aerie/sglang_plugin/launch.py" in gpu and f"{PLUGIN_ROOT}/aerie/errors.py" in gpu
    # One layer, the same lines in both: the plugin is built once per recipe from the same instruction.
    assert plugin_layer(GPU_RECIPE) == plugin_layer(CPU_RECIPE)
    assert GPU_RECIPE.read_text().count("\nFROM lmsysorg/sglang:v") == 1


def test_the_cpu_recipe_is_the_setup_sglang_environment() -> None:
    text = CPU_RECIPE.read_text()
    assert "--no-deps" in text and '"sglang==$SGLANG_VERSION"' in text and "-r /tmp/sglang.lock" in text
    assert ("envs/sglang/requirements.lock", "/tmp/sglang.lock") in [(s[0], d) for s, d in copies(CPU_RECIPE)]
    assert "CPU-lane scaffolding" in text and "COPY tests/sglang_cpu_shims" in text


@pytest.mark.docker
@pytest.mark.integration
def test_the_built_cpu_image_holds_exactly_the_plugin_files() -> None:
    client: Any = engine()
    require_image(client, SGLANG_CPU_IMAGE)
    listing = client.containers.run(
        SGLANG_CPU_IMAGE,
        entrypoint=["find", PLUGIN_ROOT, "-type", "f", "-not", "-path", "*/__pycache__/*"],
        command=[],
        remove=True,
        labels={"aerie.check": "plugin-files"},
    )
    inside = sorted(listing.decode().split())
    assert inside == sorted(installed_files(GPU_RECIPE, PLUGIN_ROOT))
