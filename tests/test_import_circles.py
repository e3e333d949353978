"""scripts/import_circles.py: finds circles of imports, deferred and TYPE_CHECKING ones too."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("import_circles", ROOT / "scripts" / "import_circles.py")
assert _spec is not None and _spec.loader is not None
circles_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(circles_mod)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_deferred_import_closes_a_circle(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a/__init__.py": "from pkg.a import one\n",
            "pkg/a/one.py": "def f():\n    from pkg.b import two\n",
            "pkg/b/__init__.py": "",
            "pkg/b/two.py": "from ..a.one import f\n",
        },
    )
    found = circles_mod.circles(root, ["pkg"])
    assert [(kind, ring) for kind, _, ring in found] == [
        ("modules", ["pkg.a.one", "pkg.b.two", "pkg.a.one"]),
        ("packages", ["pkg.a", "pkg.b", "pkg.a"]),
    ]


def test_a_type_checking_import_closes_a_circle(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a/__init__.py": "",
            "pkg/a/one.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b.two import g\n",
            "pkg/b/__init__.py": "",
            "pkg/b/two.py": "from pkg.a import one\n",
        },
    )
    found = circles_mod.circles(root, ["pkg"])
    assert [(kind, ring) for kind, _, ring in found] == [
        ("modules", ["pkg.a.one", "pkg.b.two", "pkg.a.one"]),
        ("packages", ["pkg.a", "pkg.b", "pkg.a"]),
    ]


def test_a_package_reexporting_its_modules_and_a_settings_module_are_no_circle(tmp_path: Path) -> None:
    """`pkg.settings` gathers `pkg.a.config`; `pkg.a.stage` reads `pkg.settings`: no package circle,
    since a package's settings module is a node of its own."""
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/settings.py": "from pkg.a.config import AConfig\n",
            "pkg/a/__init__.py": "from pkg.a.stage import run\n",
            "pkg/a/config.py": "AConfig = dict\n",
            "pkg/a/stage.py": "from pkg.settings import AConfig\n\ndef run(): ...\n",
        },
    )
    assert circles_mod.circles(root, ["pkg"]) == []


def test_the_library_has_no_import_circle() -> None:
    assert circles_mod.circles(ROOT, circles_mod.DEFAULT_ROOTS) == []
