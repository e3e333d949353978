"""CPU test shim for `sgl_kernel` (see tests/sglang_cpu_shims/_shim.py): every call raises and is recorded."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _shim  # noqa: E402

_shim.install(sys.modules[__name__])
