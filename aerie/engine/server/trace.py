"""A profile of a few extraction packs on the reference server (`--trace-packs SKIP:COUNT --trace-dir D`).

On an H200 the server's device was busy forwarding 66-86% of the steady wall, and neither the phase
clocks nor a sampling profiler of the Python threads could say what it waited on in between. This
runs `torch.profiler` over packs [SKIP, SKIP+COUNT) (SKIP lets the server reach its steady state) on
every thread and the device, and writes to D:

    trace.json.gz   the Chrome trace (chrome://tracing, Perfetto): CPU ops per thread, kernels and
                    copies per stream
    ops.txt         the ops by self time (`key_averages`), CPU and device
    summary.json    the window's wall, and per device stream: busy time (the union of its kernels and
                    copies), its share of the window, and the gaps between them (count, total, the
                    longest ten with the kernel before each)

The profiler's own overhead slows the traced packs: read the gaps and their order, not the rate.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from aerie.engine.server.sglang_log import logger

GAP_US = 20.0  # shorter gaps between kernels are launch latency, not waiting


class PackTrace:
    """Called by the model thread around each extraction pack: starts the profiler before pack `skip`,
    and after pack `skip + count - 1` waits for the device, stops and writes the files. Once written it
    does nothing more."""

    def __init__(self, out_dir: Path, skip: int, count: int, device: str) -> None:
        self.out_dir = Path(out_dir)
        self.skip, self.count = skip, count
        self.device = device
        self._packs = 0
        self._prof: torch.profiler.profile | None = None
        self.done = False

    def before_pack(self) -> None:
        if self._packs == self.skip and not self.done:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.startswith("cuda"):
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.start()

    def after_pack(self) -> None:
        self._packs += 1
        if self._prof is None or self._packs < self.skip + self.count:
            return
        prof, self._prof = self._prof, None
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()  # the traced packs' kernels and copies, all of them
        prof.stop()
        self.done = True
        try:
            self._write(prof)
        except (OSError, RuntimeError) as exc:  # a trace must never take the server down
            logger.warning(f"pack trace not written to {self.out_dir}: {exc}")

    def _write(self, prof: torch.profiler.profile) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        raw = self.out_dir / "trace.json"
        prof.export_chrome_trace(str(raw))
        data = raw.read_bytes()  # read once: gzipped for the record, parsed for the summary
        raw.unlink()
        (self.out_dir / "trace.json.gz").write_bytes(gzip.compress(data))
        events = json.loads(data)
        sort = "self_cuda_time_total" if self.device.startswith("cuda") else "self_cpu_time_total"
        (self.out_dir / "ops.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
        summary = {"packs": [self.skip, self.skip + self.count], **summarize(events)}
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        logger.info(
            f"pack trace of packs {self.skip}..{self.skip + self.count - 1} written to {self.out_dir}"
        )


def summarize(trace: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
    """Busy time and gaps per device stream of a Chrome trace (microseconds)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    if not spans:
        return {"wall_us": 0.0, "streams": {}}
    begin = min(float(e["ts"]) for e in spans)
    end = max(float(e["ts"]) + float(e["dur"]) for e in spans)
    by_stream: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for e in spans:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            start = float(e["ts"])
            by_stream[str(e.get("tid"))].append((start, start + float(e["dur"]), str(e.get("name", ""))[:80]))
    return {
        "wall_us": round(end - begin, 1),
        "streams": {stream: _stream(sorted(items), end - begin) for stream, items in by_stream.items()},
    }


def _stream(items: list[tuple[float, float, str]], wall: float) -> dict[str, Any]:
    busy = 0.0
    gaps: list[tuple[float, str]] = []
    cur_start, cur_end, last = items[0]
    for start, end, name in items[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            if start - cur_end >= GAP_US:
                gaps.append((start - cur_end, last))
            cur_start = start
        cur_end = max(cur_end, end)
        last = name
    busy += cur_end - cur_start
    gaps.sort(reverse=True)
    return {
        "events": len(items),
        "busy_us": round(busy, 1),
        "busy_share_of_wall": round(busy / wall, 3) if wall > 0 else None,
        "gaps_over_20us": len(gaps),
        "gap_us_total": round(sum(g for g, _ in gaps), 1),
        "longest_gaps": [{"us": round(g, 1), "after": name} for g, name in gaps[:10]],
    }
