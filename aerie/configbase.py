"""The base of every aerie config model: strict, described, assignment-validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A pydantic model that refuses unknown fields, so a misspelt key fails loudly."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
