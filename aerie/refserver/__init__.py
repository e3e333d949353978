"""aerie.refserver."""
