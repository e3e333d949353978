"""HTTP request bodies: SGLang's `/generate` and OpenAI's `/v1/chat/completions`, the parts aerie uses.

Like SGLang 0.5.23, unknown *top-level* keys are ignored but an unknown `sampling_params` key is a
400: a typo in a decoding parameter must not silently change what is generated. Parameters SGLang
has but this server does not implement are accepted only at their neutral value, and otherwise
rejected with a message naming them (never silently ignored).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from aerie.engine.generation import SamplingParams

# Parameters SGLang accepts whose only supported value here is the neutral one.
_NEUTRAL: dict[str, Any] = {
    "n": 1,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "stop_regex": None,
}


class RequestError(ValueError):
    """A request that cannot be served as asked; becomes a 400 with this message."""


class SamplingParamsBody(BaseModel):
    """SGLang's `sampling_params` (the server implements all but the neutral-only ones)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(128, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    stream_interval: int | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    stop_regex: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None

    def to_params(self, *, max_new_tokens_cap: int, seed: int | None = None) -> SamplingParams:
        _check_neutral(self.model_dump(), "sampling_params")
        wanted = self.max_new_tokens if self.max_new_tokens is not None else max_new_tokens_cap
        return SamplingParams(
            max_new_tokens=min(wanted, max_new_tokens_cap),
            min_new_tokens=self.min_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop=_as_tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            seed=self.sampling_seed if self.sampling_seed is not None else seed,
        )


def _as_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(s for s in stop if s)


def _check_neutral(values: dict[str, Any], where: str) -> None:
    for key, neutral in _NEUTRAL.items():
        if key in values and values[key] != neutral:
            raise RequestError(
                f"{where}.{key}={values[key]!r} is not supported by the aerie reference server "
                f"(only {neutral!r})"
            )


class GenerateBody(BaseModel):
    """SGLang's `GenerateReqInput`, the subset aerie sends. Unknown top-level keys are ignored."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_hidden_states: bool | list[bool] = False
    return_logprob: bool | list[bool] = False
    stream: bool = False

    @field_validator("input_ids")
    @classmethod
    def _non_empty(cls, v: list[int] | list[list[int]] | None) -> list[int] | list[list[int]] | None:
        if v is not None and (not v or any(isinstance(x, list) and not x for x in v)):
            raise ValueError("input_ids must not be empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    reasoning_content: str | None = None  # an earlier assistant turn's reasoning, for the template

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it (Qwen3's and Kimi's read `reasoning_content`)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise RequestError(f"message content part of type {part.get('type')!r}: only text is served")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionBody(BaseModel):
    """OpenAI's chat completion request. Unknown keys are ignored, as SGLang does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    stream: bool = False
    logprobs: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # SGLang's extensions: template variables (e.g. enable_thinking), and whether a reasoning parser's
    # split is returned (false: the reasoning stays inline in `content`).
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True

    def to_params(self, *, max_new_tokens_cap: int) -> SamplingParams:
        _check_neutral(self.model_dump(), "request")
        if self.logprobs:
            raise RequestError("logprobs=true is not supported by the aerie reference server")
        wanted = self.max_completion_tokens or self.max_tokens or max_new_tokens_cap
        return SamplingParams(
            max_new_tokens=min(wanted, max_new_tokens_cap),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop=_as_tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            seed=self.seed,
        )


def validation_message(exc: ValidationError, where: str) -> str:
    """One line per problem, with its location, e.g. `sampling_params.max_new_token: Extra inputs...`."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in (where, *err["loc"]) if p != "")
        lines.append(f"{loc}: {err['msg']}")
    return "; ".join(lines)


def error_body(message: str, code: int = 400, kind: str = "BadRequestError") -> dict[str, Any]:
    """SGLang's (OpenAI-style) error object."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code}
