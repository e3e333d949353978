"""The slot decoder's decoding step with static shapes, replayed as CUDA graphs.

Why: a 256-row step of SmolLM2 is ~1,400 kernel launches, 19 ms of CPU for 5 ms of GPU on an H200;
a graph replays them in one launch. Graphs need fixed shapes and addresses, so every graph runs all
`rows` rows (free rows decode token 0 at position 0 of their own unused cache row, which the next
admission overwrites) over a fixed cache width, reading ids and positions from static buffers and
writing logits into a static buffer, all allocated before any capture.

Memory, the pattern PyTorch documents and vLLM/SGLang use for decode graphs:

- warm-up and capture run on ONE side stream (`CudaGraphRunner`). cuBLAS keeps a workspace per
  (handle, stream), allocated on first use through the caching allocator and held for the life of
  the process (ATen/cuda/CublasHandlePool.cpp, `setWorkspaceForHandle`). If that first use is inside
  a capture, the workspace comes out of the graph's private pool and pins it; the warm-up on the
  capture stream creates it outside any pool.
- one pool per generation of the KV buffers: all widths of a generation are captured back to back,
  largest first, into one fresh `graph_pool_handle()`, so the smaller graphs reuse the largest one's
  scratch memory; the outputs live outside the pool, so sharing it is safe in any replay order.
- when the KV buffers are reallocated (they grow by doubling) the graphs hold dead addresses: they
  are dropped together with their pool, and the next generation gets a fresh pool. Never capture
  into a pool whose graphs are gone: the allocator then still holds the pool (it has live blocks)
  with a use count of 0, and `capture_begin` fails with "it->second->use_count > 0 INTERNAL ASSERT
  FAILED" (c10/cuda/CUDACachingAllocator.cpp, `create_or_incref_pool`). That is what the first
  version did (it kept `graph.pool()` across a cache growth); the live block was most likely the
  workspace above (its warm-up ran on a different stream from the capture).

The first replay of each graph is checked against the eager forward on the same inputs; a capture
error or a disagreement turns graphs off for good (logged) and decoding goes on eagerly. Without a
runner (`runner=None`) the same static-shape forward runs eagerly: what the CPU tests check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

import torch

from aerie.engine.server.sglang_log import logger


class Cache(Protocol):
    """What the graphs read of the KV cache (`aerie.engine.server.slots.KVSlots` has it; that module
    imports this one)."""

    @property
    def device(self) -> torch.device | str: ...

    @property
    def length(self) -> int:
        """Positions allocated per row."""
        ...

    @property
    def version(self) -> int:
        """Bumped whenever the buffers are reallocated (captured graphs hold pointers)."""
        ...

    def ensure(self, rows: int, length: int) -> None: ...


# decode(ids [R], positions [R], rows [R], width) -> logits [R, V]: one token per row over the
# first `width` cache positions
Decode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]

_MAX_GRAPHS = 16  # widths captured per cache generation (each costs _WARMUPS eager steps + a capture)
_WARMUPS = 2  # eager runs on the capture stream before each capture (SGLang runs two)
_TOLERANCE = 2e-2  # relative error of a first replay against the eager forward (bf16 logits)


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphRunner(Protocol):
    """The CUDA side of `DecodeGraphs` (`CudaGraphRunner`); the CPU tests give it a stand-in."""

    def new_pool(self) -> object: ...

    def warm_up(self, body: Callable[[], object]) -> None: ...

    def capture(self, body: Callable[[], object], pool: object) -> Graph: ...


class CudaGraphRunner:
    """Warm-up and capture on one side stream of our own (see the module docstring for why)."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()

    def new_pool(self) -> object:
        return torch.cuda.graph_pool_handle()

    def warm_up(self, body: Callable[[], object]) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(_WARMUPS):
                body()
        torch.cuda.current_stream().wait_stream(self.stream)

    def capture(self, body: Callable[[], object], pool: object) -> Graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=self.stream):  # type: ignore[arg-type]
            body()
        return graph


def plan_widths(length: int, quantum: int, max_graphs: int = _MAX_GRAPHS) -> list[int]:
    """Cache widths to capture for a cache of `length` positions, largest (`length`) first: evenly
    spaced multiples of `quantum`, at most `max_graphs` of them."""
    step = -(-length // (quantum * max_graphs)) * quantum
    return list(range(length, 0, -step))


def pad_width(widths: list[int], width: int) -> int:
    """The smallest planned width that holds `width` positions."""
    return min(w for w in widths if w >= width)


class DecodeGraphs:
    """Static-shape decoding steps for `rows` rows, replayed as CUDA graphs when given a runner."""

    def __init__(
        self,
        decode: Decode,
        kv: Cache,
        rows: int,
        *,
        vocab: int,
        dtype: torch.dtype,
        runner: GraphRunner | None,
        quantum: int,
        max_graphs: int = _MAX_GRAPHS,
    ) -> None:
        self.decode, self.kv, self.rows, self.runner = decode, kv, rows, runner
        self.quantum, self.max_graphs = quantum, max_graphs
        device = kv.device
        # Static inputs and output, allocated once, outside any graph pool.
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.pos = torch.zeros(rows, dtype=torch.long, device=device)
        self.index = torch.arange(rows, device=device)
        self.out = torch.empty(rows, vocab, dtype=dtype, device=device) if runner is not None else None
        self.widths: list[int] = []  # of the current cache generation, largest first
        self.graphs: dict[int, Graph] = {}  # width -> graph, in capture order
        self.checked: set[int] = set()  # widths whose first replay matched the eager forward
        self.pool: object | None = None  # the current generation's pool, alive while its graphs are
        self.kv_version = -1
        self.captured = 0  # graphs captured over all generations
        self.disabled = ""

    @property
    def capture(self) -> bool:
        return self.runner is not None

    def logits(self, next_ids: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor | None:
        """Logits [n, V] of the n running rows' next tokens (`next_ids` at positions `lengths`, cache
        width `width` needed), or None to decode eagerly."""
        if self.disabled:
            return None
        self.kv.ensure(self.rows, width)
        if self.kv.version != self.kv_version:
            self._new_generation()
        padded = pad_width(self.widths, width)
        n = next_ids.shape[0]
        self.ids[:n].copy_(next_ids)
        self.ids[n:].zero_()
        self.pos[:n].copy_(lengths)
        self.pos[n:].zero_()
        if self.runner is None:
            return self._forward(padded)[:n]
        if self.pool is None:
            try:
                self._capture_all(self.runner)
            except torch.OutOfMemoryError:
                self.drop()  # the caller frees memory and captures again later
                raise
            except RuntimeError as exc:
                self._disable(f"CUDA graph capture failed: {type(exc).__name__}: {exc}")
                return None
        if padded not in self.checked:
            return self._first_replay(padded, n)
        self.graphs[padded].replay()
        assert self.out is not None
        return self.out[:n]

    # -- internals -------------------------------------------------------------------------------

    def _forward(self, width: int) -> torch.Tensor:
        return self.decode(self.ids, self.pos, self.index, width)

    def _captured_step(self, width: int) -> torch.Tensor:
        assert self.out is not None
        return self.out.copy_(self._forward(width))

    def drop(self) -> None:
        """Drop every graph and its pool (they may point at freed memory); the next step captures anew."""
        self.graphs.clear()
        self.checked.clear()
        self.pool = None
        self.widths = []
        self.kv_version = -1  # the next step plans its widths on the buffers of then

    def _new_generation(self) -> None:
        # The graphs hold the old buffers' addresses. Their pool goes with them: once they are
        # destroyed it can't be captured into again (see the module docstring).
        self.graphs.clear()
        self.checked.clear()
        self.pool = None
        self.widths = plan_widths(self.kv.length, self.quantum, self.max_graphs)
        self.kv_version = self.kv.version

    def _capture_all(self, runner: GraphRunner) -> None:
        """Every width of this generation, largest first, into one fresh pool. The warm-ups run the
        real inputs: whatever width, they only rewrite the K/V at the rows' current positions, which
        the step itself writes again before reading."""
        pool = runner.new_pool()
        for width in self.widths:
            body = functools.partial(self._captured_step, width)
            runner.warm_up(body)
            self.graphs[width] = runner.capture(body, pool)
            self.captured += 1
        self.pool = pool

    def _first_replay(self, width: int, n: int) -> torch.Tensor | None:
        eager = self._forward(width)[:n].float()  # the same inputs; rewrites the same K/V
        self.graphs[width].replay()
        assert self.out is not None
        error = float((self.out[:n].float() - eager).norm() / eager.norm().clamp_min(1e-6))
        if not error <= _TOLERANCE:  # NaN included
            self._disable(f"graph replay disagrees with the eager forward (relative error {error:.3g})")
            return None
        self.checked.add(width)
        return self.out[:n]

    def _disable(self, reason: str) -> None:
        self.disabled = reason[:300]
        self._new_generation()  # drops the graphs and their pool
        logger.warning(f"Decoding eagerly from now on: {self.disabled}")
