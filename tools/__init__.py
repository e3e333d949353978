"""Developer tools that live beside aerie, not in it (run from a checkout: `python -m tools.<name>`)."""
