"""Prefect flows: thin wrappers that compose, retry and report aerie stages."""
