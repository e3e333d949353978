"""The deployment report: one table row per server and concurrency level, and the promotion."""

from __future__ import annotations

from typing import Any

from aerie.evaluate.report import markdown_table


def benchmark_table(rows: list[dict[str, Any]]) -> list[str]:
    """The deployment benchmark: one row per server and concurrency level."""
    header = [
        "server",
        "concurrency",
        "output tok/s",
        "TTFT p50 ms",
        "ITL p50 ms",
        "latency p50 s",
        "accept length",
        "speed-up",
    ]
    body = [
        [
            r["server"],
            str(r["concurrency"]),
            r["output_tokens_per_s"],
            _ms(r["ttft_p50_s"]),
            _ms(r["itl_p50_s"]),
            r["latency_p50_s"],
            r.get("accept_length"),
            r.get("speedup"),
        ]
        for r in rows
    ]
    return markdown_table(header, body)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def deployment_markdown(report: dict[str, Any]) -> str:
    decision = report["promotion"]
    lines = [
        f"# Deployment benchmark: {report['target']['name']}",
        "",
        f"Speculative server: `{report['servers']['speculative']['command']}`",
        "",
        f"Baseline server: `{report['servers']['baseline']['command']}`",
        "",
        f"Same {report['num_prompts']} prompts per level, greedy, max {report['max_new_tokens']} new tokens. "
        f"TTFT: {report['ttft_method']}. ITL = (latency - TTFT) / (output tokens - 1). "
        "Accept length = Σ completion tokens / Σ spec_verify_ct from the server's meta_info.",
        "",
        *benchmark_table(report["rows"]),
        "",
        f"**Promotion: {'promoted' if decision['promoted'] else 'not promoted'}** — {decision['reason']}",
    ]
    if decision.get("promoted_prefix"):
        lines.append(f"\nPromoted drafter: `{decision['promoted_prefix']}`")
    return "\n".join(lines) + "\n"
