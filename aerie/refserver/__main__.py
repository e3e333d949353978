"""`python -m aerie.refserver --model-path DIR [--mode extract --dump-dir DIR] ...`"""

from __future__ import annotations

from aerie.refserver.server import main

raise SystemExit(main())
