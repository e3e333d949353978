"""How big the slot decoder's KV cache and running batch may be, from the memory the device has.

The slot decoder's cache is a rectangle: `rows x positions` cells per layer (K and V), where the
positions grow to the longest running request, up to the model's context. With CUDA graphs every
graph runs all `max_running` rows, so the rectangle is `max_running x longest`. A batch sized for a
card with more memory grows that rectangle until an allocation fails (512 rows of SmolLM2-135M at
8,192 positions are 96.6 GB in bfloat16; an H100 has 80). So the server works out, before it serves:

- the cache's budget in cells: `--max-total-tokens` when given (the user's setting wins), else the
  memory the cache may take divided by a cell's bytes (K and V of every layer for one position). On
  CUDA that memory is `--mem-fraction-static` of the card (SGLang's meaning: weights and cache
  together) less what is in use now (the weights); on the CPU, that fraction of the host's available
  memory;
- the running batch: `--max-running-requests`. With CUDA graphs (every step runs all rows) it is
  lowered where that many rows at the full context would not fit the budget, so that any request the
  server accepts fits once admitted; without them rows are allocated as requests join, and admission
  makes a request wait until the cache has room for it.

`KVPlan.line()` is the one log line that says what was chosen and why.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

GIB = 2**30


@dataclass(frozen=True)
class KVPlan:
    """The cache budget and the running batch the slot decoder gets."""

    cell_bytes: int  # K and V of every layer, one position of one row
    capacity: int  # cells (rows x positions) the cache may hold
    positions: int  # the longest a row can grow (the context, rounded up to the cache's quantum)
    max_running: int  # rows decoded together
    asked_running: int  # --max-running-requests
    budget_bytes: int  # the memory the cache may take
    source: str  # where the budget came from
    fixed_rows: bool = True  # every step runs all max_running rows (CUDA graphs)

    @property
    def lowered(self) -> bool:
        return self.max_running < self.asked_running

    def line(self) -> str:
        """What was chosen and why, in one line."""
        gb = self.capacity * self.cell_bytes / GIB
        head = (
            f"KV cache plan: {self.capacity:,} cells ({gb:.2f} GB at {self.cell_bytes:,} bytes per cell) "
            f"from {self.source}; rows grow to {self.positions:,} positions"
        )
        if self.lowered:
            need = self.asked_running * self.positions * self.cell_bytes / GIB
            return (
                f"{head}; max_running_requests lowered from {self.asked_running} to {self.max_running}: "
                f"{self.asked_running} rows x {self.positions:,} positions need {need:.2f} GB (raise "
                f"--max-total-tokens or --mem-fraction-static to run more)"
            )
        if self.fixed_rows:
            return f"{head}; max_running_requests {self.max_running} fits at the full context"
        return (
            f"{head}; max_running_requests {self.max_running}: rows are allocated as requests join, and a "
            "request waits until the cache has room for it"
        )


def cell_bytes(num_layers: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one cached position of one row: K and V of every layer."""
    return 2 * num_layers * kv_heads * head_dim * itemsize


def device_budget(device: str, fraction: float) -> tuple[int, str]:
    """The bytes the cache may take on `device`, and a phrase saying how that was worked out."""
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        used = total - free
        budget = max(0, int(fraction * total) - used)
        return budget, (
            f"--mem-fraction-static {fraction:g} of the card's {total / GIB:.1f} GB less {used / GIB:.2f} GB "
            f"in use ({free / GIB:.2f} GB free)"
        )
    available = psutil.virtual_memory().available
    return int(fraction * available), (
        f"--mem-fraction-static {fraction:g} of the host's {available / GIB:.1f} GB available"
    )


def plan_kv(
    *,
    cell: int,
    context: int,
    quantum: int,
    asked_running: int,
    max_total_tokens: int | None,
    budget: tuple[int, str],
    fixed_rows: bool = True,
) -> KVPlan:
    """The plan for a cache of `cell`-byte cells whose rows grow to `context` positions; `fixed_rows`:
    every step runs all rows (CUDA graphs)."""
    positions = -(-context // quantum) * quantum
    if max_total_tokens is not None:
        capacity = max_total_tokens
        budget_bytes, source = capacity * cell, "--max-total-tokens"
    else:
        budget_bytes, source = budget
        capacity = budget_bytes // cell
    running = max(1, min(asked_running, capacity // positions)) if fixed_rows else asked_running
    return KVPlan(cell, capacity, positions, running, asked_running, budget_bytes, source, fixed_rows)
