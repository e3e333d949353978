"""aerie.draft."""
