"""The base of every aerie config model: strict, described, assignment-validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A pydantic model that refuses unknown fields, so a misspelt key fails loudly."""

    # Numbers become strings where a string is wanted: `server.extra_args=[--max-batch-tokens,65536]` on the
    # command line is YAML, which reads 65536 as an int.
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, frozen=False, coerce_numbers_to_str=True
    )
