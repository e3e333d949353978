"""The generation stage for one dataset: `run(cfg, spec, stage_dir) -> StageResult`, into its StageDir.

One call = one dataset = stage `generate-<name>`. Its key covers what decides the output (the dataset
spec, its sampling and the endpoint's model) and not how it is reached (URL, key, concurrency,
timeouts), so a run against a freshly launched reference server on another port is still a cache hit.

Resume works below the stage key: the journal is keyed by the dataset's source and the hash of the
generation parameters only, so raising `num_samples` reuses every conversation already generated.
With a local store the journal lives in the store; with a remote one it lives in a local work dir and
is copied to the store every `journal_upload_interval_s` (another machine can resume from it).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Coroutine, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from dotenv import dotenv_values

from aerie.conversation import Conversation
from aerie.datasets import LoadReport, check_yield, describe_skips, iter_conversations, source_fingerprint
from aerie.errors import ConfigError, EndpointError, Interrupted
from aerie.generate.client import ChatClient, public_url
from aerie.generate.config import DatasetSpec, GenerateConfig, sends_key_in_clear, url_problem
from aerie.generate.interrupt import RESUME, Active
from aerie.generate.journal import Journal
from aerie.generate.output import SCHEMA, write_conversations
from aerie.generate.preflight import check_endpoint
from aerie.generate.runner import Outcome, generate_conversations, progress_message
from aerie.manifest import StageDir, StageResult, canonical_json, stage_key
from aerie.progress import ProgressFn, no_progress
from aerie.settings import get_settings
from aerie.store import ArtifactStore

log = logging.getLogger(__name__)

T = TypeVar("T")
CONVERSATIONS = "conversations.parquet"
ERRORS = "errors.jsonl"


def stage_name(spec: DatasetSpec) -> str:
    return f"generate-{spec.name}"


def generation_params(cfg: GenerateConfig, spec: DatasetSpec) -> dict[str, Any]:
    """Everything that changes what the target is asked or how it samples: the resume key."""
    return {
        "model": cfg.endpoint.model,
        "sampling": spec.sampling.model_dump(mode="json"),
        "system_prompt": spec.system_prompt,
        "max_turns": spec.max_turns,
        "regenerate": spec.regenerate,
        "max_context_tokens": spec.max_context_tokens or None,
    }


def params_hash(cfg: GenerateConfig, spec: DatasetSpec) -> str:
    return hashlib.sha256(canonical_json(generation_params(cfg, spec))).hexdigest()[:16]


# Fields that decide whether a source is accepted, not what is generated from it: outside every key.
_ACCEPTANCE_FIELDS: dict[str, Any] = {"source": {"max_invalid_fraction"}}


def key_of(cfg: GenerateConfig, spec: DatasetSpec) -> str:
    """The stage key: the dataset spec, the model, and the source file's content (a file fixed in
    place is a new input, never a cache hit on what the old bytes gave)."""
    content = {
        "dataset": spec.model_dump(mode="json", exclude=_ACCEPTANCE_FIELDS),
        "model": cfg.endpoint.model,
        "source_sha256": source_fingerprint(spec.source),
    }
    if cfg.chat_template_sha256 is not None:  # the target's own template: keys as they were
        content["chat_template_sha256"] = cfg.chat_template_sha256
    return stage_key(stage_name(spec), content)


def read_api_key(env_name: str) -> str | None:
    """The key from the environment, else from `./.env` (as .env.example documents); None if unset."""
    value = os.environ.get(env_name)
    if not value and Path(".env").is_file():
        value = dotenv_values(".env").get(env_name)
    return (value or "").strip() or None


def run(
    cfg: GenerateConfig,
    spec: DatasetSpec,
    stage_dir: StageDir,
    *,
    base_url: str | None = None,
    progress: ProgressFn = no_progress,
    server_start_s: float = 0.0,
    preflight: bool = True,
) -> StageResult:
    """Generate one dataset into `stage_dir` (its `generate-<dataset>` StageDir, made by the stage from
    `key_of`), or return its cached result. `base_url` overrides `cfg.endpoint.base_url`:
    the pipeline passes the URL of the reference server it launched, and `server_start_s` the seconds
    that server took to start (counted in the dataset's time). `preflight`: check the endpoint first
    (`aerie.generate.preflight`; off when the caller has checked it already)."""
    cached = stage_dir.cached_result()
    if cached is not None:
        progress(1.0, "cached")
        return cached
    if preflight:
        check_endpoint_for(cfg, spec, base_url)  # fails in seconds, before any data is read
    else:
        _endpoint_url(cfg, spec, base_url)  # fail on a missing URL before reading any data
    report = LoadReport(source=spec.name)
    conversations = load_source(spec, report)
    return generate_dataset(
        conversations,
        cfg,
        spec,
        stage_dir=stage_dir,
        base_url=base_url,
        report=report,
        progress=progress,
        server_start_s=server_start_s,
    )


def load_source(spec: DatasetSpec, report: LoadReport) -> list[Conversation]:
    """The dataset's conversations, read whole before any request is sent: a source that is mostly (or
    all) malformed fails here with counts by reason and line numbers, before any money is spent."""
    conversations = list(iter_conversations(spec.source, spec.name, limit=spec.num_samples, report=report))
    check_yield(spec.source, spec.name, report)
    if report.skipped:
        log.warning("dataset %r: %s", spec.name, describe_skips(report))
    if report.truncated:
        log.warning("dataset %r: %s", spec.name, report.truncated)
    if report.repaired.get("lone_surrogate_replaced"):
        log.warning(
            "dataset %r: %d conversations held a lone surrogate (half an emoji), replaced by U+FFFD",
            spec.name,
            report.repaired["lone_surrogate_replaced"],
        )
    return conversations


_RUNNING: set[tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]]] = set()
_RUNNING_LOCK = threading.Lock()


def cancel_running() -> None:
    """Cancel every generation running in this process (each in its thread's event loop)."""
    with _RUNNING_LOCK:
        for loop, task in _RUNNING:
            loop.call_soon_threadsafe(task.cancel)


async def _registered(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` as a task that `cancel_running` can cancel from another thread."""
    entry = (asyncio.get_running_loop(), asyncio.current_task())
    assert entry[1] is not None
    with _RUNNING_LOCK:
        _RUNNING.add(entry)  # type: ignore[arg-type]
    try:
        return await coro
    finally:
        with _RUNNING_LOCK:
            _RUNNING.discard(entry)  # type: ignore[arg-type]


def _endpoint_url(cfg: GenerateConfig, spec: DatasetSpec, base_url: str | None) -> str | None:
    url = base_url or cfg.endpoint.base_url
    if spec.regenerate and not url:
        raise ConfigError(
            f"dataset {spec.name!r} is regenerated but no endpoint is set: give generate.endpoint.base_url "
            "(e.g. https://openrouter.ai/api/v1) or let the pipeline launch the reference server"
        )
    if spec.regenerate and url:
        _check_key_transport(cfg, url)
    return url


def check_endpoint_for(cfg: GenerateConfig, spec: DatasetSpec, base_url: str | None) -> None:
    """The endpoint's URL checked (`_endpoint_url`), then, for a dataset that asks the target, one GET
    proving the endpoint answers and accepts the key (`aerie.generate.preflight`)."""
    url = _endpoint_url(cfg, spec, base_url)
    if spec.regenerate and url and cfg.endpoint.preflight:
        check_endpoint(cfg.endpoint, url, read_api_key(cfg.endpoint.api_key_env))


def _check_key_transport(cfg: GenerateConfig, url: str) -> None:
    """Refuse to send the API key in cleartext to another machine, unless allowed in the config."""
    problem = url_problem(url)
    if problem:
        raise ConfigError(f"generation endpoint {public_url(url)}: {problem}")
    key_env = cfg.endpoint.api_key_env
    if sends_key_in_clear(url) and not cfg.endpoint.allow_insecure and read_api_key(key_env):
        raise ConfigError(
            f"generation endpoint {public_url(url)} is plain http:// on another machine: the API key in "
            f"${key_env} would travel in cleartext. Use https://, or set "
            "generate.endpoint.allow_insecure=true if this network is trusted"
        )


def generate_dataset(
    conversations: Iterable[Conversation],
    cfg: GenerateConfig,
    spec: DatasetSpec,
    *,
    stage_dir: StageDir,
    base_url: str | None = None,
    report: LoadReport | None = None,
    progress: ProgressFn = no_progress,
    server_start_s: float = 0.0,
) -> StageResult:
    """The stage's work on any iterable of conversations: generate, write the Parquet and errors,
    finish with the manifest. Raises `EndpointError` when more conversations failed than allowed.
    `server_start_s`, the start of the server generating for it, counts in the stage's seconds."""
    url = _endpoint_url(cfg, spec, base_url)
    phash = params_hash(cfg, spec)
    local_dir, remote_prefix = journal_location(cfg, spec, stage_dir, phash)
    mirror = JournalMirror(stage_dir.store, remote_prefix, local_dir) if remote_prefix else None
    if mirror is not None:
        mirror.pull()
    progress(0.0, f"generating {spec.name}")
    outcome = Outcome()
    with Active(), Journal(local_dir, phash, lead_s=server_start_s) as journal:
        try:
            client_stats = _run_sync(
                _generate(conversations, cfg, spec, journal, url, progress, mirror, outcome)
            )
        except (KeyboardInterrupt, asyncio.CancelledError) as exc:
            raise Interrupted(_kept_line(spec, outcome, mirror, local_dir)) from exc
        finally:
            journal.flush()
            if mirror is not None:
                mirror.push()
        errors_info = _put_errors(stage_dir, outcome, local_dir)
        _check_failures(spec, outcome, stage_dir)
        return _finish(
            stage_dir, cfg, spec, journal, outcome, client_stats, url, report, errors_info, progress
        )


async def _generate(
    conversations: Iterable[Conversation],
    cfg: GenerateConfig,
    spec: DatasetSpec,
    journal: Journal,
    url: str | None,
    progress: ProgressFn,
    mirror: JournalMirror | None,
    outcome: Outcome,
) -> dict[str, Any]:
    """Fills `outcome` as it goes; returns the client's figures."""
    client = (
        ChatClient(cfg.endpoint, url, read_api_key(cfg.endpoint.api_key_env))
        if spec.regenerate and url
        else None
    )
    try:
        await generate_conversations(
            conversations,
            spec,
            journal,
            client=client,
            concurrency=cfg.endpoint.concurrency,
            max_failure_fraction=cfg.max_failure_fraction,
            progress=progress,
            on_tick=mirror.push if mirror else None,
            tick_interval_s=cfg.journal_upload_interval_s,
            outcome=outcome,
        )
    finally:
        if client is not None:
            await client.aclose()
    stats: dict[str, Any] = {}
    if client is not None:
        stats = {
            "requests": client.stats.requests,
            "retries_by_kind": dict(client.stats.retries),
            "models_served": dict(client.stats.models),
        }
        if client.server_slot is not None:  # the server generation launched: its relaunches so far
            stats["server_restarts"] = client.server_slot.restarts
    return stats


def _kept_line(spec: DatasetSpec, outcome: Outcome, mirror: JournalMirror | None, local_dir: Path) -> str:
    """What a stopped generation kept, in one line (with the resume hint when it stands alone)."""
    where = mirror.store.uri(mirror.prefix) if mirror is not None else str(local_dir)
    total = f" of {outcome.requested}" if outcome.requested else ""
    return (
        f"dataset {spec.name!r}: {outcome.finished}{total} conversations kept ({outcome.done_now} "
        f"finished in this run) in {where}; {RESUME}"
    )


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion, also from a thread whose event loop is already running
    (a notebook, an async flow): then in a fresh thread with its own loop."""
    try:
        asyncio.get_running_loop()
        in_loop = True
    except RuntimeError:
        in_loop = False
    if not in_loop:
        return asyncio.run(_registered(coro))
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, _registered(coro)).result()


def journal_location(
    cfg: GenerateConfig, spec: DatasetSpec, stage_dir: StageDir, phash: str
) -> tuple[Path, str | None]:
    """(local journal dir, store prefix to mirror it to or None when the journal is in the store)."""
    source = spec.source.model_dump(mode="json", exclude=_ACCEPTANCE_FIELDS["source"])
    digest = hashlib.sha256(
        canonical_json({"name": spec.name, "source": source, "params": phash})
    ).hexdigest()[:16]
    prefix = f"{stage_dir.run}/{stage_dir.stage}/journal/{digest}"
    local = stage_dir.store.local_path(prefix)
    if local is not None:
        return local, None
    root = Path(cfg.work_dir).expanduser() if cfg.work_dir else get_settings().cache_dir / "generate"
    return root / stage_dir.run / stage_dir.stage / digest, prefix


class JournalMirror:
    """Keeps a remote store's copy of a local journal: pulled before a run, pushed while it runs."""

    def __init__(self, store: ArtifactStore, prefix: str, local_dir: Path) -> None:
        self.store, self.prefix, self.local_dir = store, prefix, local_dir
        self._pushed: dict[str, tuple[int, int]] = {}

    def pull(self) -> None:
        """Download the parts this machine lacks (written by a run elsewhere)."""
        self.local_dir.mkdir(parents=True, exist_ok=True)
        for key in self.store.list(self.prefix):
            dest = self.local_dir / key.rsplit("/", 1)[-1]
            if not dest.exists():
                self.store.get_file(key, dest)
                st = dest.stat()
                self._pushed[dest.name] = (st.st_size, st.st_mtime_ns)

    def push(self) -> None:
        """Upload the parts that changed since the last push (a torn last line is dropped on read)."""
        for path in sorted(self.local_dir.glob("*.jsonl")):
            st = path.stat()
            if self._pushed.get(path.name) != (st.st_size, st.st_mtime_ns):
                self.store.put_file(f"{self.prefix}/{path.name}", path)
                self._pushed[path.name] = (st.st_size, st.st_mtime_ns)


def _put_errors(stage_dir: StageDir, outcome: Outcome, local_dir: Path) -> dict[str, Any]:
    """errors.jsonl: the conversations that failed in this run (every earlier failure was retried)."""
    path = local_dir / f".{ERRORS}.tmp"
    with open(path, "w", encoding="utf-8") as f:
        for failure in outcome.failures.values():
            f.write(json.dumps(failure, ensure_ascii=False) + "\n")
    info = stage_dir.store.put_file(stage_dir.path(ERRORS), path)
    path.unlink(missing_ok=True)
    return {"key": info.key, "sha256": info.sha256, "bytes": info.size, "rows": len(outcome.failures)}


def _check_failures(spec: DatasetSpec, outcome: Outcome, stage_dir: StageDir) -> None:
    failed = len(outcome.failures)
    if not outcome.aborted and failed <= outcome.allowed_failures:
        return
    share = failed / max(1, outcome.requested)
    stopped = " (stopped early: the dataset could no longer pass)" if outcome.aborted else ""
    raise EndpointError(
        f"dataset {spec.name!r}: {failed} of {outcome.requested} conversations failed ({share:.1%}), "
        f"more than generate.max_failure_fraction allows ({outcome.allowed_failures}){stopped}; "
        f"errors by kind: {outcome.errors_by_kind()}; details in {stage_dir.uri(ERRORS)}. "
        f"{outcome.finished} finished conversations are kept: a re-run retries only the failures."
    )


def _finish(
    stage_dir: StageDir,
    cfg: GenerateConfig,
    spec: DatasetSpec,
    journal: Journal,
    outcome: Outcome,
    client_stats: dict[str, Any],
    url: str | None,
    report: LoadReport | None,
    errors_info: dict[str, Any],
    progress: ProgressFn,
) -> StageResult:
    found = journal.records()
    wanted = ((i, outcome.inputs[i]) for i in outcome.requested_ids)
    ordered = [found[key] for key in wanted if key in found]
    tmp = journal.dir / f".{CONVERSATIONS}.tmp"
    rows = write_conversations(ordered, tmp)
    info = stage_dir.store.put_file(stage_dir.path(CONVERSATIONS), tmp)
    tmp.unlink(missing_ok=True)

    prompt_tokens = sum(r["prompt_tokens"] for r in ordered)
    completion_tokens = sum(r["completion_tokens"] for r in ordered)
    costs = [r["cost"] for r in ordered if r["cost"] is not None]
    truncated = sum(1 for r in ordered if "length" in r["finish_reasons"])
    past_context = sum(r.get("turns_past_context", 0) for r in ordered)
    seconds = max(outcome.seconds, 1e-9)
    earlier_runs, earlier_s = journal.earlier_runs()
    # A resumed dataset's time is every run's: the records (and so the tokens) are every run's too; and
    # each run's server start is in it (the GPU was held for the stage from the launch).
    total_s = max(outcome.seconds + journal.lead_s + earlier_s, 1e-9)
    throughput = {
        "runs": earlier_runs + 1,
        "wall_seconds": round(total_s, 3),
        "completion_tokens_per_s": round(completion_tokens / total_s, 3),
        "conversations_per_s": round(rows / total_s, 3),
        "this_run": {
            "requests": outcome.requests,
            "requests_per_s": round(outcome.requests / seconds, 3),
            "completion_tokens_per_s": round(outcome.completion_tokens / seconds, 3),
            "tokens_per_s": round((outcome.prompt_tokens + outcome.completion_tokens) / seconds, 3),
            "wall_seconds": round(outcome.seconds, 3),
            "server_start_s": round(journal.lead_s, 3),
            "conversations": outcome.done_now,
        },
    }
    counts = {
        "requested": outcome.requested,
        "done": rows,
        "done_in_earlier_runs": outcome.done_before,
        # Resume by id and input: reused from the journal; generated (or, kept as is, read) in this
        # run; of those, the ones the journal held from another input (their source changed).
        "reused": outcome.done_before,
        "regenerated": outcome.done_now,
        "changed": outcome.changed,
        "failed": len(outcome.failures),
        "skipped_by_loader": report.total_skipped if report else 0,
        "skipped": dict(outcome.skipped),
        "truncated": truncated,
        "turns_past_context": past_context,
    }
    figures = {
        "records": rows,
        "failed": len(outcome.failures),
        "skipped": (report.total_skipped if report else 0) + sum(outcome.skipped.values()),
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cost_usd": round(sum(costs), 6) if costs else None,
        # Some answers priced, some not: the sum is a lower bound, and says so.
        "cost_usd_partial": bool(costs) and len(costs) < rows,
        "unpriced": rows - len(costs) if costs else 0,
        "truncated": truncated,
        "requests_per_s": throughput["this_run"]["requests_per_s"],
        "tokens_per_s": throughput["completion_tokens_per_s"],
        "wall_s": throughput["wall_seconds"],
        "server_start_s": round(journal.lead_s, 3),
        "runs": throughput["runs"],
    }
    manifest = {
        # The stage's seconds: this call's with its server's start, plus the runs it resumed.
        "seconds": round(time.monotonic() - stage_dir.started + journal.lead_s + earlier_s, 3),
        "figures": figures,
        "dataset": spec.model_dump(mode="json"),
        "endpoint": {
            "base_url": public_url(url) if url else None,
            "model": cfg.endpoint.model,
            "provider": cfg.endpoint.provider,
            "models_served": client_stats.get("models_served", {}),
            # Relaunches of the server generation launched, when it died (None: a remote endpoint).
            "server_restarts": client_stats.get("server_restarts"),
        },
        "generation": {"params": generation_params(cfg, spec), "params_hash": journal.params_hash},
        "counts": counts,
        "loader": _loader_summary(report),
        "tokens": {"prompt": prompt_tokens, "completion": completion_tokens},
        "cost_usd": figures["cost_usd"],
        "errors_by_kind": outcome.errors_by_kind(),
        "retries_by_kind": client_stats.get("retries_by_kind", {}),
        "throughput": throughput,
        "files": {
            CONVERSATIONS: {"key": info.key, "sha256": info.sha256, "bytes": info.size, "rows": rows},
            ERRORS: errors_info,
        },
        "schema": {name: str(dtype) for name, dtype in SCHEMA.items()},
    }
    result = stage_dir.finish(manifest)
    progress(1.0, progress_message(outcome, outcome.seconds))
    return result


def _loader_summary(report: LoadReport | None) -> dict[str, Any]:
    if report is None:
        return {}
    return {
        "loaded": report.loaded,
        "skipped": dict(report.skipped),
        "repaired": dict(report.repaired),
        "truncated": report.truncated,
        # Where the first skipped records are ("line 7: invalid_json (...)"), so they can be fixed.
        "examples": list(report.examples),
    }
