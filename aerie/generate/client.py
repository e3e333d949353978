"""An async OpenAI-compatible chat-completions client built for long unattended generation runs.

One shared `httpx.AsyncClient` (keep-alive pool sized to the concurrency) serves every request. A
request that fails for a reason that may pass (timeouts, dropped connections, 408/409/429/5xx,
malformed JSON, an empty `choices`, an in-band provider error) is retried with exponential backoff and
jitter, honouring `Retry-After`; a 429's `Retry-After` pauses every request, since the limit is the
account's, not the request's. A failure that cannot pass is never retried: 401/403 raise
`EndpointAuthError`, 404 and a 400 on a request shape that never worked raise `EndpointRequestError`,
and both stop the dataset with a message that says what to fix. So do a redirect (3xx: not followed,
since a redirected POST may lose its body or key; the message names where it points) and a 200 whose
body is not JSON and says so (an HTML login page, an SSE stream): it will not change on a retry, and
the message gives its content type and the start of its body. The API key is sent only in the
Authorization header and is scrubbed from every message this module builds.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import random
import ssl
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from aerie.errors import EndpointAuthError, EndpointRequestError, RequestFailedError
from aerie.generate.config import EndpointConfig, SamplingParams
from aerie.generate.ratelimit import RateLimiter
from aerie.generate.transport import Http11Transport
from aerie.version import __version__

RETRYABLE_STATUS = frozenset({408, 409, 429})
# 400s that name one over-long prompt, not a broken configuration: that conversation fails, the run goes on.
_CONTEXT_HINTS = (
    "context length",
    "context_length",
    "context window",
    "maximum context",
    "too long",
    "too many tokens",
)


class _Transient(Exception):
    """A failure worth retrying (internal: never leaves this module)."""

    def __init__(self, kind: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.kind, self.retry_after = kind, retry_after


@dataclass(frozen=True)
class Completion:
    """One assistant turn as the endpoint returned it; `reasoning` is a thinking model's hidden part."""

    content: str
    reasoning: str | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cost: float | None
    model: str | None
    attempts: int


@dataclass
class ClientStats:
    """What the client did, for the manifest: requests sent, retries by reason, models that answered."""

    requests: int = 0
    succeeded: int = 0
    retries: Counter[str] = field(default_factory=Counter)
    models: Counter[str] = field(default_factory=Counter)


def public_url(url: str) -> str:
    """The URL without credentials or query string: safe for messages and manifests."""
    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port:
        netloc = f"{netloc}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def redirect_target(response: httpx.Response, url: str) -> str:
    """Where a 3xx answer points, safe to show (no credentials, no query), or a note that it names none."""
    location = response.headers.get("location")
    return public_url(urljoin(url, location)) if location else "(no Location header)"


def body_start(response: httpx.Response, api_key: str | None, limit: int = 200) -> str:
    """The first `limit` characters of a body, whitespace collapsed, the key (if echoed) redacted."""
    text = " ".join(response.text[: limit * 4].split())[:limit]
    return text.replace(api_key, "***") if api_key else text


def not_json(response: httpx.Response) -> bool:
    """A 200 whose body is not JSON and will not become JSON on a retry: a content type that is not
    JSON (an HTML login page, an SSE stream), or, without one, a body that starts like HTML or SSE."""
    kind = response.headers.get("content-type", "").lower()
    if kind:
        return "json" not in kind
    head = response.content[:64].lstrip()
    return head.startswith((b"<", b"data:", b"event:"))


def uses_proxy(url: str) -> bool:
    """Whether the environment (HTTP(S)_PROXY, ALL_PROXY, NO_PROXY) routes this URL through a proxy."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    if not (proxies.get(parts.scheme) or proxies.get("all")):
        return False
    return not urllib.request.proxy_bypass(parts.hostname or "")


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header: delta-seconds or an HTTP date (RFC 9110 §10.2.3)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Exponential backoff with 'equal jitter': half fixed, half random, so retries spread out but
    never collapse to zero (a thundering herd right after an outage)."""
    delay = min(cap, base * (2.0**attempt))
    return delay / 2.0 + random.uniform(0.0, delay / 2.0)


class ChatClient:
    """`await client.complete(messages, sampling)` -> `Completion`. Use as an async context manager."""

    def __init__(
        self,
        endpoint: EndpointConfig,
        base_url: str,
        api_key: str | None = None,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.safe_url = public_url(self.url)
        self._api_key = api_key or None
        self._limiter = RateLimiter(endpoint.requests_per_minute, endpoint.tokens_per_minute)
        self._slots = asyncio.Semaphore(endpoint.concurrency)
        self._pause_until = 0.0
        self.stats = ClientStats()
        from aerie.generate.relaunch import slot_for

        self.server_slot = slot_for(base_url)
        self._http = httpx.AsyncClient(
            headers=self._headers(),
            timeout=httpx.Timeout(
                connect=endpoint.connect_timeout_s,
                read=endpoint.read_timeout_s,
                write=endpoint.read_timeout_s,
                pool=None,  # the semaphore already bounds requests to the pool size
            ),
            limits=httpx.Limits(
                max_connections=endpoint.concurrency, max_keepalive_connections=endpoint.concurrency
            ),
            transport=self._transport(base_url, ssl_context),
            verify=ssl_context if ssl_context is not None else True,
        )

    def _transport(
        self, base_url: str, ssl_context: ssl.SSLContext | None
    ) -> httpx.AsyncBaseTransport | None:
        """aerie's lean HTTP/1.1 pool, unless httpx's own is asked for or a proxy applies (None = httpx's,
        which reads the proxy settings from the environment)."""
        if self.endpoint.http_transport == "httpcore" or uses_proxy(base_url):
            return None
        return Http11Transport(self.endpoint.concurrency, ssl_context=ssl_context)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "User-Agent": f"aerie/{__version__}"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        if self.endpoint.referer:
            headers["HTTP-Referer"] = self.endpoint.referer
        if self.endpoint.title:
            headers["X-Title"] = self.endpoint.title
        return headers

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def request_body(self, messages: list[dict[str, str]], sampling: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": messages,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
        }
        if self.endpoint.model is not None:
            body["model"] = self.endpoint.model
        for name in ("top_k", "presence_penalty", "seed"):
            value = getattr(sampling, name)
            if value is not None:
                body[name] = value
        if self.endpoint.provider is not None:
            body["provider"] = self.endpoint.provider
        body.update(sampling.extra_body)
        return body

    async def complete(self, messages: list[dict[str, str]], sampling: SamplingParams) -> Completion:
        """One assistant turn, retried through transient failures; raises `RequestFailedError` when
        the retries run out, `EndpointAuthError`/`EndpointRequestError` when retrying cannot help."""
        payload = json.dumps(self.request_body(messages, sampling)).encode()
        estimate = self._estimate_tokens(messages, sampling) if self._limiter.tokens else 0
        attempts_allowed = self.endpoint.max_retries + 1
        last: _Transient | None = None
        attempt = 0
        while attempt < attempts_allowed:
            await self._wait_for_pause()
            await self._limiter.acquire(estimate)
            served_by = self.server_slot.generation if self.server_slot is not None else 0
            try:
                async with self._slots:
                    completion = await self._attempt(payload, attempt + 1)
            except _Transient as exc:
                last = exc
                self._limiter.settle(estimate, 0)  # nothing was generated: give the tokens back
                if await self._relaunched(exc, served_by):
                    continue  # its server died and serves again: the attempt does not count
                attempt += 1
                if attempt < attempts_allowed:
                    self.stats.retries[exc.kind] += 1
                    await asyncio.sleep(self._retry_delay(exc, attempt - 1))
                continue
            used = completion.prompt_tokens + completion.completion_tokens
            self._limiter.settle(estimate, used or None)  # no usage reported: keep the estimate
            return completion
        assert last is not None
        raise RequestFailedError(
            last.kind, self._scrub(f"{last} (gave up after {attempts_allowed} attempts)"), attempts_allowed
        )

    async def _relaunched(self, exc: _Transient, served_by: int) -> bool:
        """A request to a server generation launched failed (no connection, or a 5xx: a server whose
        steps keep failing answers 503 until its watch ends it): if that server is dead, relaunch it (or
        wait for the relaunch another request started) and say so. Raises `EndpointError` once its
        relaunches are used up."""
        if self.server_slot is None or not (exc.kind == "connection" or exc.kind.startswith("http_5")):
            return False
        return await asyncio.to_thread(self.server_slot.revive, served_by, exc)

    @staticmethod
    def _estimate_tokens(messages: list[dict[str, str]], sampling: SamplingParams) -> int:
        # ~4 characters per token is the usual rule of thumb; the real usage replaces it afterwards.
        return sum(len(m["content"]) for m in messages) // 4 + sampling.max_tokens

    def _retry_delay(self, exc: _Transient, attempt: int) -> float:
        if exc.retry_after is not None:
            delay = min(exc.retry_after, self.endpoint.max_retry_after_s)
            if exc.kind == "http_429":
                self._pause_until = max(self._pause_until, time.monotonic() + delay)
            return delay
        return backoff_delay(attempt, self.endpoint.backoff_base_s, self.endpoint.backoff_max_s)

    async def _wait_for_pause(self) -> None:
        wait = self._pause_until - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)

    async def _attempt(self, payload: bytes, attempt: int) -> Completion:
        self.stats.requests += 1
        try:
            response = await self._http.post(self.url, content=payload)
        except httpx.TimeoutException as exc:
            raise _Transient("timeout", f"{type(exc).__name__} from {self.safe_url}") from exc
        except httpx.TransportError as exc:
            raise _Transient("connection", f"{type(exc).__name__} talking to {self.safe_url}: {exc}") from exc
        if response.status_code != 200:
            self._raise_for_status(response)
        if not_json(response):
            raise EndpointRequestError(self._not_json_message(response))
        completion = self._parse(response.content, attempt)
        self.stats.succeeded += 1
        if completion.model:
            self.stats.models[completion.model] += 1
        return completion

    def _raise_for_status(self, response: httpx.Response) -> None:
        status = response.status_code
        detail = self._scrub(response.text[:300].strip())
        where = f"{self.safe_url} answered HTTP {status}"
        if status in (401, 403):
            raise EndpointAuthError(
                f"the endpoint rejected the API key in ${self.endpoint.api_key_env} (HTTP {status}): "
                f"check the key{'' if self._api_key else ' (none is set)'}; {where}: {detail}"
            )
        if 300 <= status < 400:
            raise EndpointRequestError(
                f"{where}, a redirect to {redirect_target(response, self.url)}: aerie does not follow "
                "redirects (a redirected POST may lose its body or API key); set generate.endpoint.base_url "
                "to the address it points to"
            )
        if status == 402:
            raise EndpointRequestError(f"{where}: payment required: add credits to the account. {detail}")
        if status == 404:
            raise EndpointRequestError(
                f"{where}: not found: check endpoint.base_url (it should end in /v1) and endpoint.model "
                f"({self.endpoint.model!r}). {detail}"
            )
        if status in RETRYABLE_STATUS or status >= 500:
            retry_after = parse_retry_after(response.headers.get("retry-after"))
            raise _Transient(f"http_{status}", f"{where}: {detail}", retry_after)
        if status in (400, 413, 422) and (self.stats.succeeded > 0 or _names_context(detail)):
            # Requests like this one have worked, so the configuration is fine and this prompt is not.
            raise RequestFailedError("rejected", f"{where}: {detail}", 1)
        raise EndpointRequestError(
            f"{where} before any request succeeded: the request itself is wrong; check the model name and "
            f"the sampling parameters of the dataset (extra_body included). {detail}"
        )

    def _parse(self, raw: bytes, attempt: int) -> Completion:
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise _Transient("malformed_json", f"{self.safe_url} returned a body that is not JSON") from exc
        if not isinstance(data, dict):
            raise _Transient("malformed_json", f"{self.safe_url} returned JSON that is not an object")
        choices = data.get("choices")
        if not choices:
            error = data.get("error")
            if isinstance(error, dict) and error.get("code") in (401, 403):
                raise EndpointAuthError(
                    f"the endpoint rejected the API key in ${self.endpoint.api_key_env}: check the key"
                )
            if error:
                raise _Transient("endpoint_error", f"{self.safe_url}: {self._scrub(str(error)[:300])}")
            raise _Transient("empty_choices", f"{self.safe_url} returned no choices")
        try:
            choice = choices[0]
            message = choice.get("message") or {}
            content = message.get("content") or ""
            reasoning = message_reasoning(message)
            finish = choice.get("finish_reason") or "unknown"
            usage = data.get("usage") or {}
            cost = usage.get("cost")
            completion = Completion(
                content=_text(content),
                reasoning=None if reasoning is None else _text(reasoning),
                finish_reason=str(finish),
                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                completion_tokens=int(usage.get("completion_tokens") or 0),
                cost=None if cost is None else float(cost),
                model=data.get("model"),
                attempts=attempt,
            )
        except (AttributeError, TypeError, ValueError) as exc:
            raise _Transient(
                "malformed_json", f"{self.safe_url} returned an unexpected shape: {exc}"
            ) from exc
        if completion.finish_reason == "error":
            # OpenRouter reports a provider failure mid-generation in-band, with HTTP 200.
            raise _Transient("endpoint_error", f"{self.safe_url}: the provider failed mid-generation")
        return completion

    def _not_json_message(self, response: httpx.Response) -> str:
        kind = response.headers.get("content-type") or "no content type"
        hint = (
            "an event stream: remove `stream` from the dataset's sampling.extra_body"
            if "event-stream" in kind.lower()
            else "a page, not an API (a login or proxy page?): check generate.endpoint.base_url"
        )
        return (
            f"{self.safe_url} answered HTTP 200 with a body that is not JSON ({kind}): {hint}. "
            f"It begins: {body_start(response, self._api_key)!r}"
        )

    def _scrub(self, text: str) -> str:
        return text.replace(self._api_key, "***") if self._api_key else text


def message_reasoning(message: dict[str, Any]) -> Any:
    """A response message's reasoning in any of the shapes endpoints use: `reasoning_content` (SGLang,
    vLLM), `reasoning` (OpenRouter), or OpenRouter's `reasoning_details` parts (`text`, else `summary`)."""
    found = message.get("reasoning_content") or message.get("reasoning")
    if found:
        return found
    details = message.get("reasoning_details")
    if isinstance(details, list):
        parts = [d.get("text") or d.get("summary") for d in details if isinstance(d, dict)]
        return "".join(p for p in parts if isinstance(p, str)) or None
    return None


def _names_context(detail: str) -> bool:
    low = detail.lower()
    return any(hint in low for hint in _CONTEXT_HINTS)


def _text(value: Any) -> str:
    """Message content is a string, or (multimodal style) a list of parts with `text`."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(part.get("text", "") for part in value if isinstance(part, dict))
    raise TypeError(f"content of type {type(value).__name__}")
