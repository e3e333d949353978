"""`python -m aerie.gpuhost stage|unpack|install|env|run|pack-out|restore|config|pipeline|check ...`"""

from __future__ import annotations

from aerie.gpuhost.cli import main

raise SystemExit(main())
