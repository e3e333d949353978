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
        "ITL p99 ms",
        "latency p50 s",
        "accept length",
        "speed-up",
        "spread",
    ]
    body = [
        [
            r["server"],
            str(r["concurrency"]),
            r["output_tokens_per_s"],
            _ms(r["ttft_p50_s"]),
            _ms(r["itl_p50_s"]),
            _ms(r.get("itl_p99_s")),
            r["latency_p50_s"],
            r.get("accept_length"),
            r.get("speedup"),
            _pct(r.get("spread")),
        ]
        for r in rows
    ]
    return markdown_table(header, body)


def _pct(fraction: float | None) -> str | None:
    return None if fraction is None else f"{100 * fraction:.1f}%"


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
        *(
            [f"N-gram server: `{report['servers']['ngram']['command']}`", ""]
            if "ngram" in report["servers"]
            else []
        ),
        f"The same pool of {report['num_prompts']} prompts for every server and level (cycled at steady state), "
        f"greedy, max {report['max_new_tokens']} new tokens. "
        f"TTFT: {report['ttft_method']}. ITL: the gap between streamed chunks, shared by the tokens "
        "the later one carries. "
        "Accept length = Σ completion tokens / Σ spec_verify_ct from the server's meta_info.",
        "",
        *_steady_lines(report),
        *benchmark_table(report["rows"]),
        "",
        *_prediction_lines(report),
        *_ngram_lines(report),
        f"**Promotion: {'promoted' if decision['promoted'] else 'not promoted'}** — {decision['reason']}",
    ]
    if decision.get("promoted_prefix"):
        lines.append(f"\nPromoted drafter: `{decision['promoted_prefix']}`")
    return "\n".join(lines) + "\n"


def _steady_lines(report: dict[str, Any]) -> list[str]:
    steady = report.get("steady_state")
    if not steady:
        return []
    return [
        f"Each level at steady state: a timed window of at least {steady['level_seconds']:g} s with "
        f"{steady['requests_per_slot']} requests a slot inside it, ramp and drain outside, timed "
        f"{steady['repeats']} times; tok/s is the mean, spread the (max - min) / mean of the runs.",
        "",
    ]


def _ngram_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    if report.get("ngram") and report["ngram"] != "served":
        lines += [f"SGLang's n-gram speculation: {report['ngram']}.", ""]
    recommendation = report.get("recommendation")
    if recommendation and recommendation.get("server"):
        lines += [
            f"Recommended at concurrency {recommendation['concurrency']}: {recommendation['reason']}.",
            "",
        ]
    return lines


def _prediction_lines(report: dict[str, Any]) -> list[str]:
    """The prediction written before the serve, beside what was measured at each level."""
    prediction = report.get("prediction") or {}
    if not prediction.get("predicted"):
        why = prediction.get("why_not_predicted")
        return [f"Predicted speed-up: none ({why}).", ""] if why else []
    measured = {r["concurrency"]: r.get("speedup") for r in report["rows"] if r["server"] == "speculative"}
    lines = [
        f"Predicted before the serve ({prediction.get('source')}; the chain the fit favours per level):",
        "",
    ]
    for tier in prediction.get("tiers", []):
        c = tier["concurrency"]
        lines.append(
            f"- c{c}: predicted {tier.get('predicted_speedup')} (k={tier.get('num_steps')}: {tier.get('why')}), "
            f"measured {measured.get(c)} at k={report.get('num_steps')}"
        )
    return [*lines, ""]
