"""The FastAPI application: SGLang's endpoints, with SGLang's status semantics.

| endpoint | answer |
|---|---|
| `/health`, `/health_generate` | 503 while Starting (before the warm-up succeeds) or Draining (after SIGTERM), or once unhealthy (steps failed repeatedly: the body's `message` says why); else a real 1-token generation: 200 when any model step completes within the timeout |
| `/ready` | 200 iff Up (a flag, no generation) |
| `/server_info` (`/get_server_info`) | args, `weight_version`, `launch_command`, `version`, resolved device/dtype/aux layers, status, pid; `internal_states[0]`: counters and `extract_phases_s` (`scheduler.PhaseClock`) |
| `/model_info` (`/get_model_info`), `/v1/models` | model facts; 200 as soon as the port is open (not readiness signals) |
| `/generate` | SGLang body; `max_new_tokens: 0` = prefill only; in extract mode that writes `<rid>.safetensors`; `stream: true` (one input): server-sent events, a chunk per decoding step, then `data: [DONE]` |
| `/v1/chat/completions` | OpenAI body, chat template from the tokenizer (or `--chat-template`) with the request's `chat_template_kwargs`; with `--reasoning-parser` the reasoning comes back in `reasoning_content` (`aerie.engine.server.chat`); concurrent requests share batches; `stream: true`: OpenAI's `chat.completion.chunk` events |
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from aerie.engine.generation import GenRequest, GenResult, SamplingParams
from aerie.engine.server.args import RefServerArgs, launch_command
from aerie.engine.server.chat import ChatFormat, StreamSplitter
from aerie.engine.server.dump import check_rid
from aerie.engine.server.loader import LoadedModel
from aerie.engine.server.protocol import (
    ChatCompletionBody,
    GenerateBody,
    RequestError,
    SamplingParamsBody,
    error_body,
    validation_message,
)
from aerie.engine.server.scheduler import Scheduler, ServerUnhealthy
from aerie.engine.server.sglang_log import logger
from aerie.version import __version__

Status = Literal["Starting", "Up", "Draining"]
HEALTH_RID_PREFIX = "HEALTH_CHECK_"


@dataclass
class ServerState:
    """Everything the handlers share; mutated only on the event loop."""

    args: RefServerArgs
    loaded: LoadedModel
    aux_layers: tuple[int, ...]
    scheduler: Scheduler
    attention_backend: str = "sdpa"
    status: Status = "Starting"
    in_flight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    startup_time: dict[str, float] = field(default_factory=dict)
    chat_format: ChatFormat | None = None  # None: the tokenizer's template, no reasoning parser
    kv_plan: dict[str, Any] | None = None  # the slot decoder's cache plan (aerie.engine.server.memory)

    @property
    def served_model_name(self) -> str:
        return self.args.served_model_name or self.args.model_path

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count a request as in flight, so SIGTERM waits for it."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1


def _error(message: str, code: int = 400) -> JSONResponse:
    kinds = {400: "BadRequestError", 503: "ServiceUnavailableError", 500: "InternalServerError"}
    return JSONResponse(error_body(message, code, kinds.get(code, "Error")), status_code=code)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="aerie reference server", version=__version__)
    app.state.server = state

    @app.get("/health")
    @app.get("/health_generate")
    async def health(request: Request) -> Response:
        generate = request.url.path == "/health_generate" or os.environ.get(
            "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "1"
        ) not in ("0", "false", "False")
        return await _health(state, generate=generate)

    @app.get("/ready")
    async def ready() -> Response:
        return Response(status_code=200 if state.status == "Up" else 503)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return _server_info(state)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return _model_info(state)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        name = state.served_model_name
        card = {"id": name, "object": "model", "created": state.created, "owned_by": "aerie", "root": name}
        return {"object": "list", "data": [{**card, "max_model_len": state.loaded.context_len}]}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await _guard(state, request, _generate)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _guard(state, request, _chat)

    return app


async def _guard(state: ServerState, request: Request, handler: Any) -> Response:
    """Parse JSON, refuse while draining or unhealthy, count the request in flight, map errors to
    SGLang's bodies."""
    if state.status == "Draining":
        return _error("The server is shutting down (SIGTERM received).", 503)
    if state.scheduler.unhealthy:
        return _error(f"The server is unhealthy: {state.scheduler.unhealthy}", 503)
    began = time.perf_counter()
    try:
        payload = await request.json()
    except ValueError as exc:
        return _error(f"the body is not JSON: {exc}")
    if request.url.path == "/generate":
        state.scheduler.phases.add(request_parse=time.perf_counter() - began)
    with state.track():
        try:
            return await handler(state, payload)
        except RequestError as exc:
            return _error(str(exc))
        except ServerUnhealthy as exc:
            return _error(f"The server is unhealthy: {exc}", 503)
        except Exception as exc:  # the model or the disk failed: a 500 that says what happened
            logger.exception(f"{request.url.path} failed")
            return _error(f"{type(exc).__name__}: {exc}", 500)


async def _health(state: ServerState, *, generate: bool) -> Response:
    if state.scheduler.unhealthy:
        return _error(f"The server is unhealthy: {state.scheduler.unhealthy}", 503)
    if state.status != "Up":
        return Response(status_code=503)
    if not generate:
        return Response(status_code=200)
    started = time.monotonic()
    probe = GenRequest(
        rid=f"{HEALTH_RID_PREFIX}{uuid.uuid4().hex}",
        input_ids=[0],
        params=SamplingParams(max_new_tokens=1, temperature=0.0),
    )
    future = asyncio.wrap_future(state.scheduler.submit_generations([probe])[0])
    future.add_done_callback(lambda f: f.cancelled() or f.exception())  # consumed even when we return early
    deadline = started + state.args.health_check_timeout_s
    while time.monotonic() < deadline:
        # Healthy as soon as the probe is answered, or any model step completes after it was sent.
        if (future.done() and future.exception() is None) or state.scheduler.last_progress > started:
            return Response(status_code=200)
        if future.done():  # the probe's own step failed (and no other step completed meanwhile)
            exc = future.exception()
            return _error(f"The health probe's generation failed: {type(exc).__name__}: {exc}", 503)
        await asyncio.wait([future], timeout=0.02)
    logger.info(
        f"Health check failed. Server couldn't get a response from the model worker for last "
        f"{state.args.health_check_timeout_s:g} seconds."
    )
    return Response(status_code=503)


def _server_info(state: ServerState) -> dict[str, Any]:
    a, m, s = state.args, state.loaded, state.scheduler
    return {
        **a.resolved_dict(),
        "device": m.device,
        "dtype": str(m.dtype).removeprefix("torch."),
        "aux_layers": list(state.aux_layers),
        "aux_layers_convention": "input",
        "served_model_name": state.served_model_name,
        "launch_command": launch_command(a.launch_command),
        "version": __version__,
        "frontend": "aerie-refserver",
        "status": state.status,
        "pid": os.getpid(),
        "tp_size": 1,
        "context_len": m.context_len,
        "max_req_input_len": m.context_len - 1,
        "max_total_num_tokens": a.max_batch_tokens,
        "kv_cache": state.kv_plan,
        "unhealthy": s.unhealthy or None,
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "packed_attention": state.attention_backend,
        "startup_time": state.startup_time,
        "internal_states": [
            {
                "num_running_reqs": s.num_running,
                "num_waiting_reqs": s.num_waiting,
                "num_in_flight_http": state.in_flight,
                **vars(s.stats),
                "extract_phases_s": s.phases.snapshot(),
            }
        ],
    }


def _model_info(state: ServerState) -> dict[str, Any]:
    m = state.loaded
    return {
        "model_path": state.args.model_path,
        "served_model_name": state.served_model_name,
        "tokenizer_path": None if m.tokenizer is None else state.args.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": state.args.weight_version,
        "model_type": m.model_type,
        "architectures": [m.architecture],
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


# -- /generate ------------------------------------------------------------------------------------


@dataclass
class _Item:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    hidden_states: bool


async def _generate(state: ServerState, payload: Any) -> Response:
    parse_began = time.perf_counter()
    try:
        body = GenerateBody.model_validate(payload)
    except ValidationError as exc:
        raise RequestError(validation_message(exc, "")) from exc
    if any(body.return_logprob if isinstance(body.return_logprob, list) else [body.return_logprob]):
        raise RequestError("return_logprob is not supported by the aerie reference server")
    batch, items = _generate_items(state, body)
    if body.stream:
        return _generate_stream(state, batch, items)
    started = time.monotonic()
    state.scheduler.phases.add(request_parse=time.perf_counter() - parse_began)
    results = await _run_items(state, items)
    latency = time.monotonic() - started
    reply_began = time.perf_counter()
    out = [_generate_reply(state, item, res, latency) for item, res in zip(items, results, strict=True)]
    response = JSONResponse(out if batch else out[0])
    state.scheduler.phases.add(reply_build=time.perf_counter() - reply_began)
    return response


def _generate_stream(state: ServerState, batch: bool, items: list[_Item]) -> Response:
    """`/generate` with `stream: true`: SGLang's server-sent events, one chunk per decoding step with
    the tokens (and `meta_info`) so far, the finished reply last, then `data: [DONE]`."""
    if batch or items[0].params.max_new_tokens == 0:
        raise RequestError("stream=true takes one input that generates (max_new_tokens > 0)")
    item = items[0]
    started = time.monotonic()

    async def events() -> AsyncIterator[bytes]:
        async for update in _token_stream(state, GenRequest(item.rid, item.input_ids, item.params)):
            if isinstance(update, GenResult):
                yield _event(_generate_reply(state, item, update, time.monotonic() - started))
            else:
                yield _event(_partial_reply(state, item, *update))
        yield b"data: [DONE]\n\n"

    return StreamingResponse(_guarded_events(state, events()), media_type="text/event-stream")


async def _token_stream(
    state: ServerState, request: GenRequest
) -> AsyncIterator[tuple[list[int], dict[str, Any]] | GenResult]:
    """A generation as the model thread makes it: (tokens so far, meta so far) after each step that
    added tokens, then its GenResult."""
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[tuple[list[int], dict[str, Any]]] = asyncio.Queue()

    def sink(output_ids: list[int], meta: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(updates.put_nowait, (output_ids, meta))

    result = asyncio.wrap_future(state.scheduler.submit_generations([replace(request, stream=sink)])[0])
    sent = 0
    while not result.done():
        update = asyncio.ensure_future(updates.get())
        waiting: set[asyncio.Future[Any]] = {update, result}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not update.done():
            update.cancel()
        elif len(update.result()[0]) > sent and not result.done():
            sent = len(update.result()[0])
            yield update.result()
    yield result.result()


async def _guarded_events(state: ServerState, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Count the stream in flight (SIGTERM waits for it); an error after the 200 went out can only be
    a last chunk, as SGLang sends it."""
    with state.track():
        try:
            async for event in events:
                yield event
        except Exception as exc:  # the model failed mid-stream
            logger.exception("a streamed generation failed")
            yield _event({"error": {"message": f"{type(exc).__name__}: {exc}"}})
            yield b"data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _partial_reply(
    state: ServerState, item: _Item, output_ids: list[int], meta: dict[str, Any]
) -> dict[str, Any]:
    """A streamed chunk: the tokens so far (SGLang sends them whole, as its text)."""
    info = {
        "id": item.rid,
        "prompt_tokens": len(item.input_ids),
        "completion_tokens": len(output_ids),
        "finish_reason": None,
        **meta,
    }
    reply: dict[str, Any] = {"output_ids": output_ids, "meta_info": info}
    if state.loaded.tokenizer is not None:
        reply = {"text": _text(state, output_ids, None), **reply}
    return reply


def _generate_items(state: ServerState, body: GenerateBody) -> tuple[bool, list[_Item]]:
    prompts, batch = _prompts(state, body)
    n = len(prompts)
    sampling = _per_item(body.sampling_params, n, "sampling_params", {})
    hidden = _per_item(body.return_hidden_states, n, "return_hidden_states", False)
    if body.rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif isinstance(body.rid, str) and not batch:
        rids = [body.rid]
    elif isinstance(body.rid, list) and batch and len(body.rid) == n:
        rids = list(body.rid)
    else:
        raise RequestError(f"rid must be a string for one input, or a list of {n} strings for a batch")
    items = []
    for i, (ids, sp, rid, hs) in enumerate(zip(prompts, sampling, rids, hidden, strict=True)):
        where = f"sampling_params[{i}]" if batch else "sampling_params"
        items.append(_Item(rid, ids, _sampling(state, sp, ids, where), bool(hs)))
    _check_extraction(state, items)
    return batch, items


def _prompts(state: ServerState, body: GenerateBody) -> tuple[list[list[int]], bool]:
    if (body.text is None) == (body.input_ids is None):
        raise RequestError("Either text or input_ids should be provided (exactly one).")
    if body.input_ids is not None:
        raw: list[Any] = list(body.input_ids)
        batch = isinstance(raw[0], list)
        prompts: list[list[int]] = [list(p) for p in raw] if batch else [raw]
    else:
        tok = state.loaded.tokenizer
        if tok is None:
            raise RequestError("the server runs with --skip-tokenizer-init: send input_ids, not text")
        batch = isinstance(body.text, list)
        texts = body.text if isinstance(body.text, list) else [body.text or ""]
        prompts = [list(tok(t).input_ids) for t in texts]
    vocab = state.loaded.vocab_size
    for i, p in enumerate(prompts):
        if not p:
            raise RequestError(f"input {i} is empty")
        # min/max run in C: a Python pass over an extraction batch's 64K ids held the GIL the model
        # thread needs to launch its kernels.
        bad = [t for t in p if not 0 <= t < vocab] if min(p) < 0 or max(p) >= vocab else []
        if bad:
            raise RequestError(f"input {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if len(p) >= state.loaded.context_len:
            raise RequestError(
                f"input {i} has {len(p)} tokens; the model's context length is {state.loaded.context_len}"
            )
    return prompts, batch


def _per_item(value: Any, n: int, name: str, default: Any) -> list[Any]:
    if value is None:
        return [default] * n
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for {n} inputs")
        return value
    return [value] * n


def _sampling(state: ServerState, raw: dict[str, Any], ids: list[int], where: str) -> SamplingParams:
    try:
        body = SamplingParamsBody.model_validate(raw)
    except ValidationError as exc:
        raise RequestError(validation_message(exc, where)) from exc
    return body.to_params(max_new_tokens_cap=state.loaded.context_len - len(ids), seed=None)


def _check_extraction(state: ServerState, items: list[_Item]) -> None:
    for item in items:
        if item.hidden_states and state.args.mode != "extract":
            raise RequestError(
                "The server is not configured to return hidden states. Launch it with --mode extract "
                "(hidden states are written as dump files, never sent over HTTP)."
            )
        if item.hidden_states and item.params.max_new_tokens > 0:
            raise RequestError(
                f"rid {item.rid}: hidden states are captured for prefill-only requests (max_new_tokens 0)"
            )
    if state.args.mode == "extract":
        dumping = [i.rid for i in items if i.params.max_new_tokens == 0]
        for rid in dumping:
            problem = check_rid(rid)
            if problem:
                raise RequestError(problem)
        if len(set(dumping)) != len(dumping):
            raise RequestError("rids of prefill-only requests must be unique: each names a dump file")


async def _run_items(state: ServerState, items: list[_Item]) -> list[GenResult | dict[str, Any] | None]:
    """Per item: a GenResult for a generation, the dump meta for an extraction, None for a
    serve-mode prefill-only request (nothing to compute). A request's sequences are queued together."""
    futures: dict[int, Any] = {}
    extract = [
        i for i, it in enumerate(items) if it.params.max_new_tokens == 0 and state.args.mode == "extract"
    ]
    if extract:
        submitted = state.scheduler.submit_extractions([(items[i].rid, items[i].input_ids) for i in extract])
        futures.update(zip(extract, submitted, strict=True))
    generate = [i for i, it in enumerate(items) if it.params.max_new_tokens > 0]
    if generate:
        requests = [GenRequest(items[i].rid, items[i].input_ids, items[i].params) for i in generate]
        futures.update(zip(generate, state.scheduler.submit_generations(requests), strict=True))
    results: list[GenResult | dict[str, Any] | None] = [None] * len(items)
    for i, future in futures.items():
        results[i] = await asyncio.wrap_future(future)
    return results


def _generate_reply(
    state: ServerState, item: _Item, result: GenResult | dict[str, Any] | None, latency: float
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": item.rid,
        "prompt_tokens": len(item.input_ids),
        "cached_tokens": 0,
        "e2e_latency": latency,
    }
    if isinstance(result, GenResult):
        output_ids = result.output_ids
        meta.update(finish_reason=result.finish_reason, completion_tokens=len(output_ids), **result.meta)
    else:
        output_ids = []
        meta.update(finish_reason={"type": "length", "length": 0}, completion_tokens=0)
        if result is not None:
            meta["dump"] = result
    reply: dict[str, Any] = {"output_ids": output_ids, "meta_info": meta}
    if state.loaded.tokenizer is not None:
        reply = {"text": _text(state, output_ids, result), **reply}
    return reply


def _text(state: ServerState, output_ids: list[int], result: Any) -> str:
    tok = state.loaded.tokenizer
    if tok is None or not output_ids:
        return ""
    text = tok.decode(output_ids, skip_special_tokens=True)
    matched = result.finish_reason.get("matched") if isinstance(result, GenResult) else None
    if isinstance(matched, str) and matched in text:  # trim at the stop string, as SGLang does
        text = text[: text.index(matched)]
    return str(text)


# -- /v1/chat/completions -------------------------------------------------------------------------


async def _chat(state: ServerState, payload: Any) -> Response:
    try:
        body = ChatCompletionBody.model_validate(payload)
    except ValidationError as exc:
        raise RequestError(validation_message(exc, "")) from exc
    tok = state.loaded.tokenizer
    if tok is None:
        raise RequestError("the server runs with --skip-tokenizer-init: chat needs a tokenizer")
    chat = state.chat_format or ChatFormat(tok)
    prompt = chat.render([m.for_template() for m in body.messages], body.chat_template_kwargs)
    ids = list(tok(prompt, add_special_tokens=False).input_ids)
    if len(ids) >= state.loaded.context_len:
        raise RequestError(
            f"the prompt has {len(ids)} tokens; the context length is {state.loaded.context_len}"
        )
    params = body.to_params(max_new_tokens_cap=state.loaded.context_len - len(ids))
    request = GenRequest(f"chatcmpl-{uuid.uuid4().hex}", ids, params)
    if body.stream:
        return _chat_stream(state, request, chat, prompt, body.separate_reasoning)
    result = await asyncio.wrap_future(state.scheduler.submit_generations([request])[0])
    text = _chat_text(chat, result.output_ids, result)
    split = chat.split(prompt, text) if body.separate_reasoning else None
    choice = {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": text if split is None else split.answer,
            "reasoning_content": None if split is None else split.reasoning,
        },
        "logprobs": None,
        "finish_reason": _chat_finish(result),
        "matched_stop": result.finish_reason.get("matched"),
    }
    reply: dict[str, Any] = {
        "id": request.rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.served_model_name,
        "choices": [choice],
        **_chat_usage(result),
    }
    return JSONResponse(reply)


def _chat_text(chat: ChatFormat, output_ids: list[int], result: GenResult | None) -> str:
    """The completion's text (its reasoning tags kept where there is a parser), cut at a matched stop
    string as SGLang does."""
    text = chat.decode(output_ids) if output_ids else ""
    matched = result.finish_reason.get("matched") if result is not None else None
    if isinstance(matched, str) and matched in text:
        text = text[: text.index(matched)]
    return text


def _chat_finish(result: GenResult) -> str:
    return "stop" if result.finish_reason["type"] == "stop" else "length"


def _chat_usage(result: GenResult) -> dict[str, Any]:
    prompt, completion = len(result.request.input_ids), len(result.output_ids)
    usage = {
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
    }
    # Speculative mode: spec_verify_ct, spec_accept_length, ... as in /generate's meta_info, so a chat
    # client can measure acceptance too (an extension; OpenAI clients ignore unknown keys).
    return {**usage, "meta_info": dict(result.meta)} if result.meta else usage


def _chat_stream(
    state: ServerState, request: GenRequest, chat: ChatFormat, prompt: str, separate_reasoning: bool
) -> Response:
    """OpenAI's streamed chat: `chat.completion.chunk` events with the new text of each step (as
    `reasoning_content` and `content` deltas with a reasoning parser), the finish reason and usage last,
    then `data: [DONE]`. Text that may still turn into a stop string or a reasoning tag, or into a wider
    character, waits a step (`StreamSplitter`)."""
    created = int(time.time())
    hold = max((len(s) for s in request.params.stop), default=0)
    splitter = StreamSplitter(chat if separate_reasoning else ChatFormat(chat.tokenizer), prompt, hold)

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        head = {"id": request.rid, "object": "chat.completion.chunk", "created": created}
        return _event({**head, "model": state.served_model_name, "choices": [choice], **extra})

    async def events() -> AsyncIterator[bytes]:
        yield chunk({"role": "assistant", "content": ""})
        async for update in _token_stream(state, request):
            if isinstance(update, GenResult):
                rest = splitter.deltas(_chat_text(chat, update.output_ids, update), final=True)
                if rest:
                    yield chunk(rest)
                yield chunk({}, _chat_finish(update), **_chat_usage(update))
            else:
                delta = splitter.deltas(_chat_text(chat, update[0], None).rstrip("\ufffd"))
                if delta:
                    yield chunk(delta)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(_guarded_events(state, events()), media_type="text/event-stream")
