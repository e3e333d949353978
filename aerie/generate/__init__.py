"""Regenerate training conversations with the target through an OpenAI-compatible endpoint."""
