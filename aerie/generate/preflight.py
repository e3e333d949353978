"""One cheap request before generation starts: the endpoint answers and accepts the key.

Without it a dead endpoint is found by the first completion, after its retries (~45 s), and a
rejected key after the source is read. `check_endpoint` sends one GET (`/models`, what every
OpenAI-compatible server serves; `/key` on OpenRouter, whose `/models` answers without a key) and
fails in seconds, naming the endpoint (never the key) and what went wrong:

    connection refused          EndpointUnreachableError   nothing listens at that host and port
    no route, no DNS, timeout   EndpointUnreachableError   the host cannot be reached
    HTTP 401 / 403              EndpointAuthError          the key is missing or rejected
    HTTP 3xx                    EndpointRequestError       a redirect (not followed): names where to
    HTTP 2xx with an HTML page  EndpointRequestError       a login or proxy page, not an API: names its
                                                           content type and the start of its body
    HTTP 404 / 405 / 501        (a note, no error)         the endpoint serves no such GET: the first
                                                           completion checks it instead
    HTTP 429 / 502-504          retried twice (1 s, 2 s), then EndpointError
    any other status            EndpointRequestError (4xx) or EndpointError (5xx)
"""

from __future__ import annotations

import errno
import logging
import time
from urllib.parse import urlsplit

import httpx

from aerie.errors import EndpointAuthError, EndpointError, EndpointRequestError, EndpointUnreachableError
from aerie.generate.client import body_start, parse_retry_after, public_url, redirect_target
from aerie.generate.config import EndpointConfig
from aerie.version import __version__

log = logging.getLogger(__name__)

NOT_SERVED = frozenset({404, 405, 501})
BUSY = frozenset({429, 502, 503, 504})
ATTEMPTS = 3
READ_TIMEOUT_S = 30.0  # a listing answers at once; a completion's read timeout would hide a hang


def preflight_path(endpoint: EndpointConfig, base_url: str) -> str:
    """The GET that proves the endpoint and its key: `endpoint.preflight_path`, else derived."""
    if endpoint.preflight_path:
        return endpoint.preflight_path
    host = (urlsplit(base_url).hostname or "").lower()
    return "/key" if host == "openrouter.ai" or host.endswith(".openrouter.ai") else "/models"


def check_endpoint(endpoint: EndpointConfig, base_url: str, api_key: str | None) -> str | None:
    """Raise when the endpoint cannot serve this run; return a note when it could not tell (no such
    GET there), None when it answered and accepted the key."""
    url = base_url.rstrip("/") + preflight_path(endpoint, base_url)
    shown = public_url(url)
    headers = {"User-Agent": f"aerie/{__version__}"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    timeout = httpx.Timeout(endpoint.connect_timeout_s, read=min(endpoint.read_timeout_s, READ_TIMEOUT_S))
    with httpx.Client(headers=headers, timeout=timeout) as http:
        for attempt in range(ATTEMPTS):
            response = _get(http, url, shown, endpoint)
            if response.status_code not in BUSY or attempt + 1 == ATTEMPTS:
                break
            wait = parse_retry_after(response.headers.get("retry-after"))
            time.sleep(min(wait if wait is not None else 2.0**attempt, 5.0))
    return _verdict(response, shown, endpoint, api_key)


def _get(http: httpx.Client, url: str, shown: str, endpoint: EndpointConfig) -> httpx.Response:
    try:
        return http.get(url)
    except httpx.ConnectTimeout as exc:
        raise EndpointUnreachableError(
            f"generation endpoint {shown}: no connection within {endpoint.connect_timeout_s:g} s "
            "(generate.endpoint.connect_timeout_s): is the host right and reachable from here?"
        ) from exc
    except httpx.TimeoutException as exc:
        raise EndpointUnreachableError(
            f"generation endpoint {shown}: connected, but no answer within "
            f"{min(endpoint.read_timeout_s, READ_TIMEOUT_S):g} s"
        ) from exc
    except httpx.ConnectError as exc:
        if _refused(exc):
            raise EndpointUnreachableError(
                f"generation endpoint {shown}: connection refused: nothing listens there (is the server "
                "running, are the host and port right?)"
            ) from exc
        raise EndpointUnreachableError(f"generation endpoint {shown}: cannot connect: {exc}") from exc
    except httpx.TransportError as exc:
        raise EndpointUnreachableError(f"generation endpoint {shown}: {type(exc).__name__}: {exc}") from exc


def _refused(exc: BaseException) -> bool:
    """Whether a connect error is a refusal (errno ECONNREFUSED anywhere in its causes)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError) or getattr(seen, "errno", None) == errno.ECONNREFUSED:
            return True
        seen = seen.__cause__ or seen.__context__
    return "connection refused" in str(exc).lower()


def _verdict(
    response: httpx.Response, shown: str, endpoint: EndpointConfig, api_key: str | None
) -> str | None:
    status = response.status_code
    if 200 <= status < 300:
        kind = response.headers.get("content-type", "")
        if "html" in kind.lower():
            raise EndpointRequestError(
                f"generation endpoint {shown} answered HTTP {status} with an HTML page ({kind}), not an API "
                f"(a login or proxy page?): check generate.endpoint.base_url. It begins: "
                f"{body_start(response, api_key)!r}"
            )
        return None
    if 300 <= status < 400:
        raise EndpointRequestError(
            f"generation endpoint {shown} answered HTTP {status}, a redirect to "
            f"{redirect_target(response, str(response.request.url))}: aerie does not follow redirects; set "
            "generate.endpoint.base_url to the address it points to"
        )
    detail = response.text[:300].strip()
    if api_key:
        detail = detail.replace(api_key, "***")  # some providers echo the key they were sent
    if status in (401, 403):
        raise EndpointAuthError(
            f"generation endpoint {shown} rejected the API key in ${endpoint.api_key_env} (HTTP {status}"
            f"{'' if api_key else '; none is set'}): check the key. {detail}"
        )
    if status in NOT_SERVED:
        note = (
            f"generation endpoint {shown} answers HTTP {status} to GET: it serves no such check, so the "
            "first completion checks the endpoint and key instead"
        )
        log.warning(note)
        return note
    where = f"generation endpoint {shown} answered HTTP {status} before any generation"
    if status < 500 and status != 429:
        raise EndpointRequestError(f"{where}: {detail}")
    raise EndpointError(f"{where} (after {ATTEMPTS} attempts): {detail}")
