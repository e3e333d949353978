"""`python -m aerie.engine --model-path DIR [--mode extract --dump-dir DIR] ...`"""

from __future__ import annotations

from aerie.engine.server.lifecycle import main

raise SystemExit(main())
