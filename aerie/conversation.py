"""The one record every dataset is normalized to: a conversation of role-tagged messages."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["system", "user", "assistant"]


class Message(BaseModel):
    """One turn. `reasoning` holds a thinking model's reasoning, kept apart from the visible answer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role
    content: str
    reasoning: str | None = None


class Conversation(BaseModel):
    """A conversation from one source; `id` is stable across runs (resume keys on it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    source: str
    messages: tuple[Message, ...] = Field(min_length=1)

    def user_turns(self) -> int:
        return sum(1 for m in self.messages if m.role == "user")
