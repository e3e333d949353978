"""aerie.serving."""
