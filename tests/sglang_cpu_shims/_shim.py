"""Stand-in modules for two imports that have no CPU build on PyPI: `sgl_kernel` and `torchvision`.

Test scaffolding for the CPU lane only, never on the library's import path: tests put this directory on
the PYTHONPATH of the SGLang server they launch, and nothing else. SGLang 0.5.23's CPU engine imports
`sgl_kernel`'s CPU ops at load time (the CPU build, sglang-kernel-cpu, is not on PyPI) and then, on a
CPU without AMX, takes its native-torch path; transformers and SGLang's multimodal code import
`torchvision` (PyPI's build needs libtorch_cuda.so). A text model's forward calls neither.

So every name in these modules resolves, and calling it appends one line to the file named by
AERIE_SHIM_CALLS_FILE and raises: a test can prove that a whole run called no shim.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any

CALLS_FILE_ENV = "AERIE_SHIM_CALLS_FILE"


class ShimCalled(RuntimeError):
    """Code called into a CPU shim: the run needs the real compiled package."""


def record_call(name: str) -> None:
    path = os.environ.get(CALLS_FILE_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"{os.getpid()} {name}\n")


class ShimAttr:
    """Any attribute of a shim: more attributes below it (`InterpolationMode.BILINEAR`); a call raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return ShimAttr(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> Any:
        record_call(self._name)
        raise ShimCalled(f"{self._name} is a CPU test shim: this code path needs the real package")

    def __repr__(self) -> str:
        return f"<cpu shim {self._name}>"


class ShimModule(types.ModuleType):
    """A module whose every public name is a `ShimAttr` (dunders stay absent, for import machinery)."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return ShimAttr(f"{self.__name__}.{attr}")


class _ShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every submodule of a shim package (`sgl_kernel.flash_attn`, `torchvision.io`) on demand."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: object, target: object = None) -> Any:
        if fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = ShimModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install(package: types.ModuleType) -> None:
    """Turn the real package module `package` into a shim and serve its submodules."""
    package.__class__ = ShimModule
    sys.meta_path.insert(0, _ShimFinder(package.__name__))
