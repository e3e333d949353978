"""Generation's launched server, kept serving at its address while generation runs.

When the serving watch ends the server generation launched (it crashed, or its device was poisoned
into failing every step and it reported itself unhealthy), the requests on their way fail to connect.
The first to see it asks the server's `ServerSlot` to relaunch it, from the same spec and so on the
same port; the others wait for that relaunch; none of those failed attempts counts against
`generate.endpoint.max_retries`. Once `generate.max_server_restarts` relaunches are used up, the dataset
stops with what it finished kept in its journal, and a re-run resumes.

The slot is found by the endpoint's address: a dataset's part receives only the address (under Prefect
a subflow's parameters must be plain data), and a remote endpoint, which aerie cannot restart, has
none registered.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from aerie.errors import EndpointError

if TYPE_CHECKING:
    from aerie.serving import ServerSpec
    from aerie.serving.restarts import ServerSlot

_lock = threading.Lock()
_slots: dict[str, ServerSlot] = {}


def _key(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


@contextlib.contextmanager
def launched(spec: ServerSpec, max_restarts: int) -> Iterator[str]:
    """The server of `spec` for the block, its `/v1` address yielded, relaunched on its port (up to
    `max_restarts` times) whenever a request finds it dead."""
    from aerie.serving import ModelServer
    from aerie.serving.restarts import ServerSlot

    def exhausted(why: str) -> EndpointError:
        return EndpointError(
            f"the generation server {spec.name} died and generate.max_server_restarts={max_restarts} is "
            f"used up; the conversations finished are kept and a re-run resumes.\n{why}"
        )

    slot = ServerSlot(
        lambda attempt: ModelServer(spec).start(),
        name=spec.name,
        max_restarts=max_restarts,
        exhausted=exhausted,
    )
    try:
        server, _ = slot.get()
        with registered(f"{server.url}/v1", slot):
            yield f"{server.url}/v1"
    finally:
        slot.stop()


@contextlib.contextmanager
def registered(url: str, slot: ServerSlot) -> Iterator[None]:
    """`slot` is the server behind `url` for as long as the block runs."""
    with _lock:
        _slots[_key(url)] = slot
    try:
        yield
    finally:
        with _lock:
            _slots.pop(_key(url), None)


def slot_for(url: str) -> ServerSlot | None:
    """The launched server's slot behind `url`, or None (a remote endpoint)."""
    with _lock:
        return _slots.get(_key(url))
