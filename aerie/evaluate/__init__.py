"""aerie.evaluate."""
