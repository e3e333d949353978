"""The plugin SGLang runs in each of its processes (entry point group `sglang.srt.plugins`).

SGLang spawns its schedulers with the `spawn` start method, so patches made in the launcher process
would not reach them; its plugin loader (`sglang.srt.plugins.load_plugins`, called first thing in
every scheduler, detokenizer and the engine) does. `install()` then patches three places:

1. the model runner's `configure_aux_hidden_state_capture` (called before CUDA-graph capture): after
   SGLang's own setup, call `model.set_eagle3_layers_to_capture([1, N//2-1, N-4])` — ids in SGLang's
   *output-of-layer* convention, which every SGLang model (llama's `+1`, deepseek_v2's `+1 when the
   first id is 1`) resolves to `layers_to_capture = [2, N//2, N-3]`, the residual stream *entering*
   those layers — then read `layers_to_capture` back and refuse anything else;
2. `Scheduler.handle_generate_request`: remember the rids of requests with `max_new_tokens == 0`
   (the dump contract; SGLang's own warmup and `/health` probes generate tokens and are not dumped);
3. `LogitsProcessor.forward`: its inputs are the post-norm `hidden_states` of every token of the
   extend batch and the model's `aux_hidden_states`, whatever the capture mode — so the requests'
   capture mode stays NULL and no float goes into JSON. The batch is copied to host once, split per
   request by `ForwardBatch.extend_seq_lens_cpu`, and written per rid by a background thread.

Only TP rank 0 writes (every TP rank holds the full hidden states after the all-reduce). Pipeline
parallelism and DP attention are refused by the launcher: the states would be split across ranks.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from aerie.sglang_plugin.compat import (
    ATTACH_POINTS,
    check_sglang_version,
    default_config_fields,
    installed_sglang_version,
)
from aerie.sglang_plugin.dumps import PLUGIN_ERROR_FILE, DumpWriter, split_packed, valid_rid
from aerie.sglang_plugin.layers import eagle3_layers

logger = logging.getLogger("aerie.sglang_plugin")

DUMP_DIR_ENV = "AERIE_DUMP_DIR"
AUX_LAYERS_ENV = "AERIE_AUX_LAYERS_OUTPUT"  # optional override, output-of-layer ids "1,14,26"
_installed = False


def resolve(module: str, attr_path: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


class CaptureState:
    """Per-process state: which rids want a dump, and the writer (created on first use, in the
    scheduler process only)."""

    def __init__(self, dump_dir: Path, rank_fn: Callable[[], int] | None = None) -> None:
        self.dump_dir = dump_dir
        self.pending: set[str] = set()
        self._rank_fn = rank_fn
        self._rank: int | None = None
        self._writer: DumpWriter | None = None

    @property
    def writer(self) -> DumpWriter:
        if self._writer is None:
            self._writer = DumpWriter(self.dump_dir)
        return self._writer

    def rank(self) -> int:
        if self._rank is None:
            self._rank = self._rank_fn() if self._rank_fn is not None else 0
        return self._rank

    def note_request(self, rid: Any, max_new_tokens: Any) -> None:
        if max_new_tokens == 0 and isinstance(rid, str):
            if valid_rid(rid):
                self.pending.add(rid)
            else:  # no file can carry the error either; the client's own rids are always valid
                logger.error("aerie dump: rid %r cannot name a dump file; not dumped", rid)

    def capture(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        rids: list[str] | None,
        extend_lens: list[int] | None,
        prefix_lens: list[int] | None,
        aux_hidden_states: Any,
    ) -> int:
        """Hand the wanted requests of one extend batch to the writer; returns how many."""
        if not rids or not self.pending:
            return 0
        wanted = [r for r in rids if r in self.pending]
        if not wanted:
            return 0
        for r in wanted:
            self.pending.discard(r)
        if self.rank() != 0:
            return 0
        if extend_lens is None:
            for r in wanted:
                self.writer.error(r, "the batch carries no extend lengths: cannot split it per request")
            return 0
        if aux_hidden_states is None or (isinstance(aux_hidden_states, list) and not aux_hidden_states):
            for r in wanted:
                self.writer.error(
                    r, "the model passed no aux hidden states: EAGLE-3 capture is not active on the target"
                )
            return 0
        aux = (
            aux_hidden_states
            if isinstance(aux_hidden_states, torch.Tensor)
            else torch.cat(aux_hidden_states, -1)
        )
        slices = split_packed(rids, extend_lens, prefix_lens)
        total = sum(s.length for s in slices)
        if total != hidden_states.shape[0] or total != aux.shape[0] or total != input_ids.shape[0]:
            for r in wanted:
                self.writer.error(
                    r,
                    f"batch rows do not add up: extend lengths sum to {total}, hidden_states has "
                    f"{hidden_states.shape[0]}, aux {aux.shape[0]}, input_ids {input_ids.shape[0]}",
                )
            return 0
        ids_h, aux_h, last_h, ready = _to_host(input_ids, aux, hidden_states)
        wanted_set = set(wanted)
        n = 0
        for s in slices:
            if s.rid not in wanted_set:
                continue
            if s.prefix_len:
                self.writer.error(
                    s.rid,
                    f"the server reused {s.prefix_len} cached tokens, so only the suffix was computed: "
                    "launch with --disable-radix-cache",
                )
                continue
            end = s.start + s.length
            self.writer.submit(
                s.rid, ids_h[s.start : end], aux_h[s.start : end], last_h[s.start : end], ready
            )
            n += 1
        return n


def _to_host(*tensors: torch.Tensor) -> tuple[Any, ...]:
    """Copy to host: on CUDA into pinned memory without blocking, with an event the writer waits on
    (the copy is queued on the current stream, so later kernels reusing the memory run after it)."""
    if not tensors[0].is_cuda:
        return (*(t.detach().clone() for t in tensors), None)
    out = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t.detach(), non_blocking=True)
        out.append(host)
    event = torch.cuda.Event()
    event.record()
    return (*out, event)


def _num_layers(model: Any) -> int:
    for holder in (model, getattr(model, "language_model", None)):
        config = getattr(holder, "config", None)
        for cfg in (config, getattr(config, "text_config", None)):
            n = getattr(cfg, "num_hidden_layers", None)
            if isinstance(n, int):
                return n
    raise RuntimeError(f"cannot find num_hidden_layers on {type(model).__name__}")


def _layers_to_capture(model: Any) -> list[int] | None:
    for holder in (model, getattr(model, "language_model", None)):
        inner = getattr(holder, "model", None)
        got = getattr(inner, "layers_to_capture", None)
        if got is not None:
            return list(got)
    return None


def enable_aux_capture(model: Any, environ: dict[str, str] | None = None) -> list[int]:
    """Turn on EAGLE-3 capture of the residual stream entering layers 2, N//2, N-3; returns those
    input-convention ids after checking that the model resolved them so."""
    env = os.environ if environ is None else environ
    n = _num_layers(model)
    if env.get(AUX_LAYERS_ENV):
        output_ids = [int(x) for x in env[AUX_LAYERS_ENV].split(",")]
    else:
        output_ids = eagle3_layers(n)
    want = [i + 1 for i in output_ids]
    if not hasattr(model, "set_eagle3_layers_to_capture"):
        raise RuntimeError(
            f"{type(model).__name__} has no set_eagle3_layers_to_capture: SGLang cannot capture it"
        )
    model.set_eagle3_layers_to_capture(output_ids)
    got = _layers_to_capture(model)
    if got is not None and got != want:
        raise RuntimeError(
            f"{type(model).__name__} resolved EAGLE-3 layer ids {output_ids} (output-of-layer) to "
            f"layers_to_capture={got}, expected {want} (input-of-layer): the model's id convention differs"
        )
    logger.info(
        "aerie dump plugin: capturing the residual stream entering layers %s (= outputs of %s) of %s",
        want,
        output_ids,
        type(model).__name__,
    )
    return want


def install() -> None:
    """Entry point. Does nothing unless AERIE_DUMP_DIR is set (the launcher sets it)."""
    global _installed
    dump_dir = os.environ.get(DUMP_DIR_ENV)
    if not dump_dir or _installed:
        return
    try:
        check_sglang_version(installed_sglang_version())
        default_config_fields()
        _patch(Path(dump_dir))
        _installed = True
    except Exception as exc:
        # SGLang's loader logs and swallows plugin exceptions; leave a file the client sees at once.
        logger.exception("aerie dump plugin FAILED to attach")
        with contextlib.suppress(OSError):
            Path(dump_dir, PLUGIN_ERROR_FILE).write_text(f"pid {os.getpid()}: {type(exc).__name__}: {exc}\n")
        raise


def _patch(dump_dir: Path) -> None:
    points = {f"{m}:{a}": resolve(m, a) for m, a in ATTACH_POINTS}  # fail early, naming what moved
    lp_mod = importlib.import_module("sglang.srt.layers.logits_processor")
    sched_mod = importlib.import_module("sglang.srt.managers.scheduler")
    runner_mod = importlib.import_module("sglang.srt.model_executor.model_runner")
    state = CaptureState(
        dump_dir, points["sglang.srt.distributed.parallel_state:get_tensor_model_parallel_rank"]
    )

    configure = runner_mod.configure_aux_hidden_state_capture

    def configure_with_aux(*args: Any, **kwargs: Any) -> Any:
        result = configure(*args, **kwargs)
        enable_aux_capture(kwargs["model"] if "model" in kwargs else args[0])
        return result

    runner_mod.configure_aux_hidden_state_capture = configure_with_aux  # type: ignore[attr-defined]

    handle = sched_mod.Scheduler.handle_generate_request

    def handle_generate_request(self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
        sampling = getattr(recv_req, "sampling_params", None)
        state.note_request(getattr(recv_req, "rid", None), getattr(sampling, "max_new_tokens", None))
        return handle(self, recv_req, *args, **kwargs)

    sched_mod.Scheduler.handle_generate_request = handle_generate_request

    forward = lp_mod.LogitsProcessor.forward

    def logits_forward(
        self: Any,
        input_ids: Any,
        hidden_states: Any,
        lm_head: Any,
        logits_metadata: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        # Only a ForwardBatch carries rids; a LogitsMetadata (draft paths) is not ours.
        mode = getattr(logits_metadata, "forward_mode", None)
        if (
            state.pending
            and hasattr(logits_metadata, "rids")
            and mode is not None
            and (mode.is_extend() and not mode.is_target_verify())
        ):
            aux = args[0] if args else kwargs.get("aux_hidden_states")
            state.capture(
                input_ids,
                hidden_states,
                logits_metadata.rids,
                logits_metadata.extend_seq_lens_cpu,
                getattr(logits_metadata, "extend_prefix_lens_cpu", None),
                aux,
            )
        return forward(self, input_ids, hidden_states, lm_head, logits_metadata, *args, **kwargs)

    lp_mod.LogitsProcessor.forward = logits_forward
    logger.info("aerie dump plugin attached in pid %d: dumps to %s", os.getpid(), dump_dir)
