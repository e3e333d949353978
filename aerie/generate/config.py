"""Configuration of the generation stage."""

from __future__ import annotations

from pydantic import Field

from aerie.configbase import StrictModel
from aerie.datasets import SourceSpec


class SamplingParams(StrictModel):
    """Sampling parameters sent with every chat completion."""

    temperature: float = Field(0.0, ge=0.0, le=2.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(256, ge=1, description="Maximum completion tokens per assistant turn.")


class EndpointConfig(StrictModel):
    """Where completions come from: OpenRouter, any OpenAI-compatible server, or the reference server."""

    base_url: str | None = Field(
        None,
        description="OpenAI-compatible base URL (e.g. https://openrouter.ai/api/v1). None: the pipeline "
        "launches the reference server with the target and uses its /v1.",
    )
    model: str | None = Field(None, description="Model name sent in requests; None = the endpoint's own.")
    api_key_env: str = Field("OPENROUTER_API_KEY", description="Environment variable that holds the API key.")
    concurrency: int = Field(32, ge=1, description="Requests in flight at most.")
    requests_per_minute: float | None = Field(None, gt=0, description="Rate limit on requests; None = none.")
    tokens_per_minute: float | None = Field(None, gt=0, description="Rate limit on tokens; None = none.")
    connect_timeout_s: float = Field(10.0, gt=0, description="TCP connect timeout.")
    read_timeout_s: float = Field(300.0, gt=0, description="Read timeout of one completion.")
    max_retries: int = Field(
        6, ge=0, description="Retries of a transient failure (timeouts, 408/409/429/5xx)."
    )
    referer: str | None = Field(None, description="OpenRouter HTTP-Referer header.")
    title: str | None = Field(None, description="OpenRouter X-Title header.")
    provider: dict[str, object] | None = Field(
        None, description="OpenRouter provider routing, passed through."
    )


class DatasetSpec(StrictModel):
    """One source dataset (B1..Bn) to regenerate with the target."""

    name: str = Field(description="Dataset name; becomes the `source` column.")
    source: SourceSpec = Field(description="Where the prompts come from and how fields map.")
    num_samples: int | None = Field(None, ge=1, description="Conversations to take; None = all.")
    system_prompt: str | None = Field(
        None, description="System prompt to prepend when a conversation has none."
    )
    max_turns: int | None = Field(None, ge=1, description="User turns kept per conversation; None = all.")
    regenerate: bool = Field(
        True, description="Ask the target for every assistant turn (False: keep the data's)."
    )
    sampling: SamplingParams = Field(default_factory=SamplingParams)


class GenerateConfig(StrictModel):
    """The generation stage: one subflow per dataset."""

    endpoint: EndpointConfig = Field(default_factory=EndpointConfig)
    datasets: list[DatasetSpec] = Field(default_factory=list, description="Source datasets B1..Bn.")
    max_parallel_datasets: int = Field(2, ge=1, description="Datasets generated at the same time.")
