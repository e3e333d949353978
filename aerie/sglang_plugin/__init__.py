"""aerie.sglang_plugin."""
