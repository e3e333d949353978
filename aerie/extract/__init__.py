"""aerie.extract."""
