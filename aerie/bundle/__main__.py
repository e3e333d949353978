"""`python -m aerie.bundle install|unpack|env|check ...`: the offline side of a bundle."""

from __future__ import annotations

from aerie.bundle.cli import main

raise SystemExit(main())
