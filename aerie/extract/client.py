"""The extraction client: many sequences per `/generate` request, the dumps read back per rid.

A request carries a batch of whole samples (`input_ids` as a list of lists, one rid each,
`max_new_tokens: 0`). The server replies with each dump's key/shapes/dtype only (SGLang's reply
carries no dump info; the file name is known from the rid anyway); the client waits until every
`<dump_dir>/<rid>.safetensors` exists (written atomically, so existing means complete), maps it
(`aerie.tensorfile.load_mapped`: no copy; its bytes are copied once, into the shard), checks its token
ids against the corpus, and deletes it, so the dump dir lists only what is in flight (the pages of a
mapped dump live on until its shard is written: `aerie.extract.preflight.dumps_in_flight_bytes`).
A dump may hold the model dtype or, from a reference server run with `--dump-dtype fp8`, fp8 codes
with their scales (`aerie.engine.server.dump`): the sample then carries them to the shard writer as they are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from aerie.errors import ExtractionError
from aerie.extract.corpus_rows import Row
from aerie.extract.phases import SERVER_PHASES_KEY, RequestTiming
from aerie.sglang_plugin.dumps import (
    PLUGIN_ERROR_FILE,
    check_dump,
    dump_path,
    error_path,
)
from aerie.shards.format import HiddenSample
from aerie.tensorfile import load_mapped

DUMP_POLL_S = 0.01


class ServerUnavailable(ExtractionError):
    """The server stopped answering (connection refused/reset, 5xx, a dump that never came):
    the caller checks whether it died and restarts it."""


@dataclass
class Batch:
    """Consecutive rows sent in one request."""

    rows: list[Row]
    rids: list[str]

    @property
    def tokens(self) -> int:
        return sum(len(r.input_ids) for r in self.rows)


def make_batches(rows: Iterable[Row], batch_tokens: int, rid_prefix: str) -> Iterator[Batch]:
    """Group consecutive rows into requests of at most `batch_tokens` tokens (a longer sample goes
    alone). The rid names the split row, so a retried request overwrites, never duplicates."""
    pending: list[Row] = []
    tokens = 0
    for row in rows:
        n = len(row.input_ids)
        if pending and tokens + n > batch_tokens:
            yield Batch(pending, [f"{rid_prefix}-{r.index}" for r in pending])
            pending, tokens = [], 0
        pending.append(row)
        tokens += n
    if pending:
        yield Batch(pending, [f"{rid_prefix}-{r.index}" for r in pending])


def generate_body(batch: Batch) -> dict[str, Any]:
    return {
        "input_ids": [r.input_ids for r in batch.rows],
        "rid": batch.rids,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
    }


def clear_dumps(dump_dir: Path, rids: Iterable[str]) -> None:
    """Remove leftovers of earlier attempts at these rids (a dump written before a crash)."""
    for rid in rids:
        dump_path(dump_dir, rid).unlink(missing_ok=True)
        error_path(dump_dir, rid).unlink(missing_ok=True)


def _check_plugin(dump_dir: Path) -> None:
    plugin_error = dump_dir / PLUGIN_ERROR_FILE
    if plugin_error.exists():
        raise ExtractionError(
            f"the server's dump plugin failed to attach: {plugin_error.read_text().strip()}"
        )


async def wait_for_dump(dump_dir: Path, rid: str, timeout_s: float) -> Path:
    """The dump's path once it exists; `ExtractionError` with the server's reason if it wrote
    `<rid>.error`; `ServerUnavailable` when nothing came within the timeout."""
    path = dump_path(dump_dir, rid)
    err = error_path(dump_dir, rid)
    deadline = time.monotonic() + timeout_s
    while True:
        if path.exists():
            return path
        if err.exists():
            raise ExtractionError(f"the server could not dump {rid}: {err.read_text().strip()}")
        _check_plugin(dump_dir)
        if time.monotonic() > deadline:
            raise ServerUnavailable(
                f"no dump {path.name} in {dump_dir} {timeout_s:.0f} s after the server replied: "
                "is the server writing dumps to this directory (extraction mode, dump plugin attached)?"
            )
        await asyncio.sleep(DUMP_POLL_S)


def to_sample(row: Row, tensors: dict[str, torch.Tensor], source: str) -> HiddenSample:
    """Check a dump against its corpus row and build the sample the shard writer takes. The ids are
    compared as Python lists (one torch call, not four per sample: each must win the GIL back from
    the client's other threads), and the dump's own ids, equal to the corpus's, go on to the shard."""
    ids = tensors["input_ids"]
    got = ids.tolist()
    if got != row.input_ids:
        want = row.input_ids
        first = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
        )
        raise ExtractionError(
            f"{source}: the dump of corpus row {row.index} ({row.id}) holds {len(got)} token ids that differ "
            f"from the corpus's {len(want)} at position {first}: the server did not prefill the sample as sent"
        )
    return HiddenSample(
        id=row.id,
        input_ids=ids,
        loss_mask=torch.tensor(row.loss_mask, dtype=torch.uint8),
        aux_hidden=tensors["aux_hidden"],
        last_hidden=tensors["last_hidden"],
        # An fp8 dump (the reference server's --dump-dtype fp8) carries the shard's codes and scales.
        aux_scale=tensors.get("aux_scale"),
        last_scale=tensors.get("last_scale"),
    )


class ExtractionClient:
    """One server's HTTP client (async)."""

    def __init__(self, url: str, dump_dir: Path, *, request_timeout_s: float, dump_timeout_s: float) -> None:
        self.url = url
        self.dump_dir = Path(dump_dir)
        self.dump_timeout_s = dump_timeout_s
        self._http = httpx.AsyncClient(
            base_url=url, timeout=httpx.Timeout(request_timeout_s, connect=10.0), trust_env=False
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def post_generate(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        try:
            resp = await self._http.post("/generate", json=body)
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"POST {self.url}/generate failed: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 500:
            raise ServerUnavailable(f"POST {self.url}/generate: HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.status_code != 200:
            raise ExtractionError(
                f"POST {self.url}/generate refused the request: HTTP {resp.status_code}: {resp.text[:500]}"
            )
        out = resp.json()
        return out if isinstance(out, list) else [out]

    async def extract(self, batch: Batch, timing: RequestTiming | None = None) -> list[HiddenSample]:
        """Prefill one batch; the samples in batch order. Dumps are deleted once read. `timing`, when
        given, records when each step was reached (`aerie.extract.phases`)."""
        timing = timing if timing is not None else RequestTiming()
        timing.began = time.monotonic()
        clear_dumps(self.dump_dir, batch.rids)
        items = await self.post_generate(generate_body(batch))
        timing.replied = time.monotonic()
        if len(items) != len(batch.rids):
            raise ExtractionError(f"/generate answered {len(items)} items for {len(batch.rids)} sequences")
        for rid, item in zip(batch.rids, items, strict=True):
            dump = (item.get("meta_info") or {}).get("dump")
            if dump is not None and dump.get("key") != dump_path(self.dump_dir, rid).name:
                raise ExtractionError(
                    f"the reply for {rid} names dump {dump.get('key')!r}, expected {rid}.safetensors"
                )
        paths = [await wait_for_dump(self.dump_dir, rid, self.dump_timeout_s) for rid in batch.rids]
        timing.dumps_found = time.monotonic()
        # Reading and checking in one thread: the event loop stays free for the other requests' replies.
        samples = await asyncio.to_thread(_read_and_check, batch.rows, paths, timing)
        timing.done = time.monotonic()
        return samples

    async def server_phases(self) -> dict[str, float] | None:
        """The server's phase totals so far (the reference server's `/server_info`
        `internal_states[0].extract_phases_s`), or None where it reports none or cannot answer: a
        diagnostic, so it never fails the extraction."""
        try:
            resp = await self._http.get("/server_info", timeout=10.0)
            phases = (resp.json().get("internal_states") or [{}])[0].get(SERVER_PHASES_KEY)
            return {str(k): float(v) for k, v in phases.items()} if isinstance(phases, dict) else None
        except (httpx.HTTPError, ValueError, AttributeError, IndexError, TypeError):
            return None

    async def greedy_next_token(self, input_ids: list[int], rid: str) -> int:
        """The server's own greedy next token after `input_ids` (max_new_tokens=1)."""
        body = {
            "input_ids": input_ids,
            "rid": rid,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        }
        (item,) = await self.post_generate(body)
        ids = item.get("output_ids")
        if not ids:
            raise ExtractionError(
                f"/generate with max_new_tokens=1 returned no output_ids: {str(item)[:300]}"
            )
        return int(ids[0])


def _read_and_check(rows: list[Row], paths: list[Path], timing: RequestTiming) -> list[HiddenSample]:
    tensors = read_dumps(paths)
    timing.read = time.monotonic()
    return [to_sample(row, t, str(p)) for row, t, p in zip(rows, tensors, paths, strict=True)]


def read_dumps(paths: list[Path]) -> list[dict[str, torch.Tensor]]:
    """The dumps' tensors, memory-mapped (`load_mapped`: their bytes are copied once, into the shard,
    and the tmpfs pages are freed when the shard is written and the tensors dropped)."""
    out = []
    for p in paths:
        try:
            out.append(check_dump(load_mapped(p)[0], p))
        except (ValueError, OSError) as exc:
            raise ExtractionError(f"unreadable dump {p}: {exc}") from exc
        p.unlink(missing_ok=True)
    return out
