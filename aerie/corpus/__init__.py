"""aerie.corpus."""
