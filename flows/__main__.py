"""`python -m flows ...`: the `aerie` command (`flows.cli`)."""

import sys

from flows.cli import main

sys.exit(main())
