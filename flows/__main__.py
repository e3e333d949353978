"""`python -m flows ...`: the `aerie` command (`flows.cli`)."""

import sys

from .cli import main

sys.exit(main())
