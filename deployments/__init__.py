"""Deployment definitions used by prefect.yaml."""
