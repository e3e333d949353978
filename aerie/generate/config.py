"""Configuration of the generation stage."""

from __future__ import annotations

from datetime import date
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from aerie.configbase import StrictModel
from aerie.datasets import SourceSpec

# Source kinds read from a file the user names (the others are installed data packages).
FILE_KINDS = frozenset({"jsonl", "parquet"})


class SamplingParams(StrictModel):
    """Sampling parameters sent with every chat completion. They are part of the generation-params hash,
    so changing any of them regenerates the dataset instead of mixing two policies in one output."""

    temperature: float = Field(0.0, ge=0.0, le=2.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(256, ge=1, description="Maximum completion tokens per assistant turn.")
    top_k: int | None = Field(None, ge=1, description="Top-k sampling (SGLang/vLLM/OpenRouter); None = off.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Presence penalty; None = off.")
    seed: int | None = Field(None, description="Sampling seed, for endpoints that honour it; None = unset.")
    extra_body: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra request fields passed through verbatim, e.g. {'reasoning': {'effort': 'low'}} "
        "(OpenRouter) or {'chat_template_kwargs': {'enable_thinking': False}} (SGLang/vLLM).",
    )


LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


def url_problem(url: str) -> str | None:
    """What is wrong with an endpoint URL (scheme, host), or None."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return (
            f"the scheme must be http or https, got {parts.scheme!r}"
            if parts.scheme
            else "no scheme: write it in full, e.g. https://openrouter.ai/api/v1"
        )
    if not parts.hostname:
        return "no host"
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        return str(exc)
    return None


def sends_key_in_clear(url: str) -> bool:
    """Whether a key sent to `url` would cross a network in cleartext (http:// to another machine)."""
    parts = urlsplit(url)
    return parts.scheme == "http" and (parts.hostname or "").lower() not in LOOPBACK_HOSTS


class EndpointConfig(StrictModel):
    """Where completions come from: OpenRouter, any OpenAI-compatible server, or the reference server.
    Only `model` changes what is generated; the other fields say how to reach it and how hard to push."""

    base_url: str | None = Field(
        None,
        description="OpenAI-compatible base URL (e.g. https://openrouter.ai/api/v1). None: the pipeline "
        "launches the reference server with the target and uses its /v1.",
    )
    model: str | None = Field(
        None, description="Model name sent in requests; None = omitted, the endpoint serves its own."
    )
    api_key_env: str = Field(
        "OPENROUTER_API_KEY",
        description="Environment variable that holds the API key; unset = no Authorization header (local).",
    )
    concurrency: int = Field(32, ge=1, description="Requests in flight at most.")
    requests_per_minute: float | None = Field(None, gt=0, description="Rate limit on requests; None = none.")
    tokens_per_minute: float | None = Field(
        None, gt=0, description="Rate limit on prompt+completion tokens; None = none."
    )
    connect_timeout_s: float = Field(10.0, gt=0, description="TCP connect timeout.")
    read_timeout_s: float = Field(300.0, gt=0, description="Read timeout of one completion.")
    max_retries: int = Field(
        6, ge=0, description="Retries of a transient failure (timeouts, 408/409/429/5xx, bad JSON)."
    )
    backoff_base_s: float = Field(1.0, gt=0, description="First retry delay; doubles per attempt, jittered.")
    backoff_max_s: float = Field(60.0, gt=0, description="Longest delay between two retries.")
    max_retry_after_s: float = Field(
        300.0, gt=0, description="Cap on a server's Retry-After (a bogus huge value must not stall the run)."
    )
    http_transport: Literal["lean", "httpcore"] = Field(
        "lean",
        description="lean: aerie's HTTP/1.1 keep-alive pool (~10x less CPU per request at high concurrency); "
        "httpcore: httpx's own (HTTP proxies; used automatically when a proxy applies to the URL).",
    )
    referer: str | None = Field(None, description="OpenRouter HTTP-Referer header (app attribution).")
    title: str | None = Field(None, description="OpenRouter X-Title header (app attribution).")
    provider: dict[str, Any] | None = Field(
        None,
        description="OpenRouter provider routing (order, allow_fallbacks, quantizations...), passed through.",
    )
    price_input_per_mtok: float | None = Field(
        None, ge=0, description="US dollars per million prompt tokens (for `aerie plan`); None = unknown."
    )
    price_output_per_mtok: float | None = Field(
        None, ge=0, description="US dollars per million completion tokens (for `aerie plan`); None = unknown."
    )
    prices_date: date | None = Field(
        None, description="When the prices were taken (prices change; the plan prints the date)."
    )
    allow_insecure: bool = Field(
        False,
        description="Send the API key over plain http:// to a host other than this machine (it travels "
        "in cleartext); off: such a run is refused before any request.",
    )
    preflight: bool = Field(
        True,
        description="Before generation, one GET (preflight_path) proves the endpoint answers and accepts "
        "the key, failing in seconds; an endpoint that serves no such GET (404/405/501) is let through.",
    )
    preflight_path: str | None = Field(
        None,
        pattern=r"^/",
        description="The GET of that check, under base_url; None = /key on openrouter.ai (its /models "
        "answers without a key), /models elsewhere.",
    )
    launch_args: list[str] = Field(
        default_factory=list,
        description="With base_url None: flags of server.backend for the generation server only, after "
        "server.extra_args (e.g. the reference server's --cuda-graphs, which the deploy stage's servers "
        "must not get: its speculative backend has no graphs, so only its baseline would be sped up).",
    )

    @model_validator(mode="after")
    def _base_url_is_a_url(self) -> EndpointConfig:
        # At load: `htps://...` or a URL without a scheme would otherwise fail after 45 s of retries.
        if self.base_url is not None:
            problem = url_problem(self.base_url)
            if problem:
                raise ValueError(f"base_url {self.base_url!r}: {problem}")
        return self

    @model_validator(mode="after")
    def _prices_are_dated(self) -> EndpointConfig:
        priced = self.price_input_per_mtok is not None or self.price_output_per_mtok is not None
        if priced and self.prices_date is None:
            raise ValueError(
                "price_input_per_mtok/price_output_per_mtok are set without prices_date: say when"
            )
        return self

    @model_validator(mode="after")
    def _launch_args_need_a_launch(self) -> EndpointConfig:
        if self.launch_args and self.base_url:
            raise ValueError(
                f"launch_args {self.launch_args} apply to the server the pipeline launches, but "
                f"base_url is set ({self.base_url}): nothing is launched"
            )
        return self


class DatasetSpec(StrictModel):
    """One source dataset (B1..Bn) to regenerate with the target."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Dataset name; becomes the `source` column and the stage name.",
    )
    source: SourceSpec = Field(description="Where the prompts come from and how fields map.")
    num_samples: int | None = Field(None, ge=1, description="Conversations to take; None = all.")
    system_prompt: str | None = Field(
        None, description="System prompt to prepend when a conversation has none."
    )
    max_turns: int | None = Field(None, ge=1, description="User turns kept per conversation; None = all.")
    regenerate: bool = Field(
        True, description="Ask the target for every assistant turn (False: keep the data's)."
    )
    max_context_tokens: int | None = Field(
        None,
        ge=0,
        description="Stop regenerating a conversation once it is this long (prompt plus answer, as the "
        "endpoint counts tokens): the corpus cuts every sample at its max_length, so the turns after it "
        "would train nothing and only cost time or money. None = the pipeline's corpus.max_length; "
        "0 = answer every turn.",
    )
    sampling: SamplingParams = Field(default_factory=SamplingParams)

    @model_validator(mode="after")
    def _file_kinds_have_a_path(self) -> DatasetSpec:
        if self.source.kind in FILE_KINDS and self.source.path is None:
            raise ValueError(
                f"dataset {self.name!r}: source.kind {self.source.kind!r} reads a file, so source.path is "
                "required (kinds without one: 'sharegpt', 'mtbench', the installed data packages)"
            )
        return self


class GenerateConfig(StrictModel):
    """The generation stage: one subflow per dataset."""

    endpoint: EndpointConfig = Field(default_factory=EndpointConfig)
    datasets: list[DatasetSpec] = Field(default_factory=list, description="Source datasets B1..Bn.")
    max_parallel_datasets: int = Field(2, ge=1, description="Datasets generated at the same time.")
    max_server_restarts: int = Field(
        2,
        ge=0,
        description="Relaunches of the server generation launches (no endpoint.base_url) when it dies "
        "mid-generation (a crash, or a device that fails every step); a remote endpoint is never restarted.",
    )
    max_failure_fraction: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="Share of conversations that may fail permanently (after retries) and still complete "
        "the dataset; above it the stage fails and a re-run retries the failures.",
    )
    work_dir: str | None = Field(
        None,
        description="Local directory of the resumable journals when the store is not local; None = "
        "<cache_dir>/generate. With a local store the journals live in the store itself.",
    )
    journal_upload_interval_s: float = Field(
        60.0,
        gt=0,
        description="With a remote store: how often the journal is copied to it, so another machine can resume.",
    )
    chat_template_sha256: str | None = Field(
        None,
        description="Set by the pipeline: the sha256 of corpus.chat_template when the generation server it "
        "launches renders with that template instead of the target's (part of each dataset's key).",
    )

    @model_validator(mode="after")
    def _dataset_names_are_unique(self) -> GenerateConfig:
        # A name is the dataset's stage: two with one name would share one output.
        names = [spec.name for spec in self.datasets]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"generate.datasets: dataset names must be unique, got {names} ({twice} twice)")
        return self
