"""`python -m aerie.engine`: load, bind, warm up, serve, drain — in SGLang's order.

1. Check the arguments (a bad flag fails in a second, before any loading).
2. Load the weights, printing SGLang's load lines and shard bar; decide the packed-attention kernel.
3. Only then start uvicorn: until the weights are in, the port refuses connections, exactly like
   SGLang, so a probe can never mistake a loading server for a ready one.
4. Warm up with a real `/generate` request over HTTP; on success print
   `The server is fired up and ready to roll!` and let `/health` answer 200. A failed warm-up exits 1.
5. On SIGTERM (or SIGINT): `/health` turns 503 at once, new requests get 503, in-flight requests
   finish, then uvicorn stops and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from aerie.engine.server.args import (
    ArgsError,
    RefServerArgs,
    check_aux_layers,
    cpu_threads,
    default_aux_layers,
    parse_args,
    parse_packs,
)
from aerie.engine.server.sglang_log import READY_LINE, avail_mem_gb, logger, setup_logging, uvicorn_log_config
from aerie.engine.server.trace import PackTrace
from aerie.errors import TargetError


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    try:
        args = parse_args(argv)
        setup_logging(args.log_level)
        if args.gil_switch_us:
            sys.setswitchinterval(args.gil_switch_us / 1e6)
    except ArgsError as exc:
        logger.error(f"Invalid arguments: {exc}")
        return 2
    # SGLang 0.5.23 logs its resolved arguments as a dict (engine.py: `server_args={...}`).
    logger.info(f"server_args={args.resolved_dict()!r}")
    previous = signal.signal(signal.SIGTERM, _exit_during_startup)
    try:
        state = _start(args)
    except (TargetError, ArgsError) as exc:
        logger.error(f"Initialization failed. {exc}")
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return _serve(state)


def _pack_trace(args: RefServerArgs, device: str) -> PackTrace | None:
    if not (args.trace_packs and args.trace_dir):
        return None
    skip, count = parse_packs(args.trace_packs)
    return PackTrace(Path(args.trace_dir), skip, count, device)


def _exit_during_startup(signum: int, frame: FrameType | None) -> None:
    logger.info(f"Signal {signum} received during startup; exiting.")
    raise SystemExit(0)


def _start(args: RefServerArgs) -> Any:
    import torch

    from aerie.engine.server import packed, slots
    from aerie.engine.server.app import ServerState
    from aerie.engine.server.chat import ChatFormat
    from aerie.engine.server.extraction import HiddenStateCapture
    from aerie.engine.server.loader import load_model
    from aerie.engine.server.scheduler import Scheduler

    torch.set_num_threads(cpu_threads(args.cpu_threads))
    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    packed.register()
    loaded = load_model(
        args.model_path,
        args.device,
        args.dtype,
        skip_tokenizer=args.skip_tokenizer_init,
        trust_remote_code=args.trust_remote_code,
    )
    aux = check_aux_layers(args.aux_layers or default_aux_layers(loaded.num_layers), loaded.num_layers)
    _log_memory_plan(args, loaded)
    capture = (
        HiddenStateCapture(loaded.model, aux, loaded.device, args.dump_dtype)
        if args.mode == "extract"
        else None
    )
    backend = build_backend(args, loaded)
    # Packed prefill serves extraction and the slot decoder's admissions; the other decoders use SDPA.
    if capture is not None or isinstance(backend, slots.SlotDecoder):
        prefill = capture or HiddenStateCapture(loaded.model, aux, loaded.device)
        if prefill.packed_refusal:
            logger.info(
                f"Packed prefill does not cover {loaded.architecture}: {prefill.packed_refusal}; "
                "prefilling one sequence at a time through the model's own attention"
            )
        backend_name = prefill.choose_attention()
        reason = packed.backend_reason()
        logger.info(f"Packed prefill attention: {backend_name}" + (f" ({reason})" if reason else ""))
    else:
        backend_name = "sdpa"
    scheduler = Scheduler(
        backend,
        capture,
        Path(args.dump_dir) if args.dump_dir else None,
        max_batch_tokens=args.max_batch_tokens,
        writer_threads=args.dump_writers,
        trace=_pack_trace(args, str(loaded.device)),
        unhealthy_after=args.unhealthy_after,
        dump_metadata={
            "aux_layers": ",".join(map(str, aux)),
            "aux_layers_convention": "input",
            "model_path": args.model_path,
            "weight_version": args.weight_version,
        },
    )
    return ServerState(
        args=args,
        loaded=loaded,
        aux_layers=aux,
        scheduler=scheduler,
        attention_backend=backend_name,
        startup_time={"load_weight": round(loaded.load_seconds, 3)},
        kv_plan=_plan_info(backend),
        chat_format=None
        if loaded.tokenizer is None
        else ChatFormat.from_args(loaded.tokenizer, args.reasoning_parser, args.chat_template),
    )


def _plan_info(backend: Any) -> dict[str, Any] | None:
    """The cache plan as /server_info shows it (None for a backend without one)."""
    plan = getattr(backend, "plan", None)
    if plan is None:
        return None
    return {
        "capacity_cells": plan.capacity,
        "cell_bytes": plan.cell_bytes,
        "max_running_requests": plan.max_running,
        "asked_running_requests": plan.asked_running,
        "source": plan.source,
    }


def build_backend(args: RefServerArgs, loaded: Any) -> Any:
    """The generation backend (`aerie.engine.generation.GenerationBackend`): EAGLE-3 speculative
    decoding when asked for, else the slot or plain batched decoder."""
    from aerie.engine.generation import BatchedDecoder
    from aerie.engine.server import slots

    if args.speculative_algorithm:
        from aerie.engine.speculative.backend import create_backend

        return create_backend(loaded, args)
    supported = slots.supports(loaded.model)
    use_slots = args.decode_backend != "batched" and supported
    covered = f"model types {', '.join(sorted(slots.SUPPORTED_MODEL_TYPES))} without sliding windows"
    if args.decode_backend == "slots" and not supported:
        raise ArgsError(
            f"--decode-backend slots: the slot decoder does not cover {loaded.architecture} "
            f"(model type {loaded.model_type}; it covers {covered}); use auto or batched"
        )
    if args.decode_backend == "auto" and not supported:
        logger.info(
            f"The slot decoder does not cover {loaded.architecture} (model type {loaded.model_type}; it "
            f"covers {covered}): decoding with BatchedDecoder"
        )
    common: dict[str, Any] = {
        "eos_token_ids": loaded.eos_token_ids,
        "device": loaded.device,
        "max_running": args.max_running_requests,
        "max_prefill_tokens": args.max_batch_tokens,
        "seed": args.random_seed,
    }
    if not use_slots:
        logger.info("Decode backend: BatchedDecoder")
        return BatchedDecoder(loaded.model, loaded.tokenizer, **common)
    graphs: slots.GraphMode = "cuda" if args.cuda_graphs and str(loaded.device).startswith("cuda") else "off"
    logger.info(f"Decode backend: SlotDecoder, CUDA graphs {graphs}")
    plan = kv_plan(args, loaded, fixed_rows=graphs != "off")
    logger.info(plan.line())
    common["max_running"] = plan.max_running
    decoder = slots.SlotDecoder(
        loaded.model, loaded.tokenizer, graphs=graphs, capacity=plan.capacity, **common
    )
    decoder.plan = plan
    return decoder


def kv_plan(args: RefServerArgs, loaded: Any, *, fixed_rows: bool) -> Any:
    """The slot decoder's cache budget and running batch for this model on this device
    (`aerie.engine.server.memory`)."""
    from aerie.engine.server import memory, slots

    cfg = loaded.model.config
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or loaded.hidden_size // cfg.num_attention_heads)
    cell = memory.cell_bytes(loaded.num_layers, heads, head_dim, loaded.dtype.itemsize)
    return memory.plan_kv(
        cell=cell,
        context=int(loaded.context_len),
        quantum=slots.LENGTH_QUANTUM,
        asked_running=args.max_running_requests,
        max_total_tokens=args.max_total_tokens,
        budget=memory.device_budget(str(loaded.device), args.mem_fraction_static),
        fixed_rows=fixed_rows,
    )


def _log_memory_plan(args: RefServerArgs, loaded: Any) -> None:
    """SGLang's KV-cache lines. The reference server allocates its cache per batch, so the sizes are
    the budget of a full batch of `max_batch_tokens` tokens, not a preallocated pool."""
    cfg = loaded.model.config
    heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or loaded.hidden_size // cfg.num_attention_heads)
    elem = loaded.dtype.itemsize
    size = args.max_batch_tokens * loaded.num_layers * heads * head_dim * elem / 2**30
    logger.info(
        f"KV Cache is allocated. dtype: {loaded.dtype}, #tokens: {args.max_batch_tokens}, "
        f"K size: {size:.2f} GB, V size: {size:.2f} GB (allocated per batch)"
    )
    logger.info(f"Memory pool end. avail mem={avail_mem_gb(loaded.device):.2f} GB")
    logger.info(
        f"max_total_num_tokens={args.max_batch_tokens}, chunked_prefill_size=-1, "
        f"max_prefill_tokens={args.max_batch_tokens}, max_running_requests={args.max_running_requests}, "
        f"context_len={loaded.context_len}, available_gpu_mem={avail_mem_gb(loaded.device):.2f} GB"
    )


# -- serving ------------------------------------------------------------------------------------


def _serve(state: Any) -> int:
    import uvicorn

    from aerie.engine.server.app import create_app

    args = state.args
    config = uvicorn.Config(
        create_app(state),
        host=args.host,
        port=args.port,
        log_config=uvicorn_log_config(args.log_level),
        timeout_keep_alive=5,
    )
    server = _DrainingServer(config, state)
    state.scheduler.start()
    try:
        asyncio.run(server.serve())
    finally:
        state.scheduler.stop()
    if server.exit_code == 0 and not server.started:
        return 1  # uvicorn could not bind (it logged "[Errno 98] ... address already in use")
    return server.exit_code


class _DrainingServer:
    """uvicorn with SGLang's shutdown: SIGTERM drains in-flight requests before the port closes."""

    def __init__(self, config: Any, state: Any) -> None:
        import uvicorn

        outer = self

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                with outer._signals():
                    yield

        self.server = _Server(config)
        self.state = state
        self.exit_code = 0
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def started(self) -> bool:
        return bool(self.server.started)

    async def serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        warmup = asyncio.create_task(self._warm_up())
        try:
            await self.server.serve()
        finally:
            warmup.cancel()

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._draining:  # a second signal: stop now
            self.server.force_exit = True
            self.server.should_exit = True
            return
        self._draining = True
        assert self._loop is not None
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain(signum)))

    async def _drain(self, signum: int) -> None:
        self.state.status = "Draining"
        logger.info(f"SIGTERM received. signum={signum}. Draining requests and shutting down...")
        last_log = 0.0
        while self.state.in_flight > 0:
            if time.monotonic() - last_log >= 5:
                logger.info(f"Gracefully exiting... Remaining number of requests {self.state.in_flight}")
                last_log = time.monotonic()
            await asyncio.sleep(0.05)
        self.server.should_exit = True

    async def _warm_up(self) -> None:
        while not self.server.started:
            if self.server.should_exit:
                return
            await asyncio.sleep(0.02)
        args = self.state.args
        if args.warmup_delay_s > 0:
            await asyncio.sleep(args.warmup_delay_s)
        if not args.skip_server_warmup:
            try:
                await self._warm_up_request()
            except Exception as exc:  # any failure: SGLang logs this line and the server exits
                logger.error(f"Initialization failed. warmup error: {type(exc).__name__}: {exc}")
                self.exit_code = 1
                self.server.should_exit = True
                return
        if self.state.status == "Starting":
            logger.info(READY_LINE)  # before /health turns 200, so a watcher that sees 200 has the line
            self.state.status = "Up"

    async def _warm_up_request(self) -> None:
        import httpx

        args = self.state.args
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(args.host, args.host)
        host = f"[{host}]" if ":" in host else host
        if self.state.loaded.tokenizer is None:
            body: dict[str, Any] = {"input_ids": [10, 11, 12]}
        else:
            body = {"text": "The capital city of France is"}
        body["sampling_params"] = {"temperature": 0, "max_new_tokens": 8}
        # trust_env=False: a proxy from the environment must not intercept a request to ourselves
        # (SGLang's warm-up answered 502 through an http_proxy).
        async with httpx.AsyncClient(trust_env=False, timeout=600) as client:
            reply = await client.post(f"http://{host}:{args.port}/generate", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"/generate answered {reply.status_code}: {reply.text[:300]}")
