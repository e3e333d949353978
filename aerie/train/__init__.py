"""aerie.train."""
