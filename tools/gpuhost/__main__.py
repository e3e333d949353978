"""`python -m tools.gpuhost stage|unpack|install|env|run|pack-out|restore|config|pipeline|check ...`"""

from __future__ import annotations

from tools.gpuhost.cli import main

raise SystemExit(main())
