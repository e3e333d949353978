"""CPU test shim for `torchvision` (see tests/sglang_cpu_shims/_shim.py): every call raises and is recorded."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _shim  # noqa: E402

__version__ = "0.28.0+cpushim"
_shim.install(sys.modules[__name__])
