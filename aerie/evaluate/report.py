"""The evaluation and deployment reports: markdown tables and the acceptance-per-position plot.

Rows are plain dicts (what report.json holds), so a report can be re-rendered from its JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aerie.diskspace import writing
from aerie.errors import EvaluationError
from aerie.evaluate.config import PROMPT_LOOKUP
from aerie.evaluate.positions import NAMES, position_table

ACCEPTANCE_PNG = "acceptance.png"


def proposer_label(r: dict[str, Any]) -> str:
    """A proposer as the tables name it: greedy rows by the proposer alone, sampled rows with their
    temperature (`eagle3 T=0.6`), so each (proposer, temperature) is its own row."""
    t = r.get("temperature") or 0.0
    return str(r["proposer"]) if not t else f"{r['proposer']} T={t:g}"


def _num(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_num(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return lines


def acceptance_table(results: list[dict[str, Any]]) -> list[str]:
    """Acceptance length per dataset x proposer (rows) and num_steps (columns)."""
    steps = sorted({r["num_steps"] for r in results})
    keys: list[tuple[str, str]] = []
    for r in results:
        if (r["dataset"], proposer_label(r)) not in keys:
            keys.append((r["dataset"], proposer_label(r)))
    by = {(r["dataset"], proposer_label(r), r["num_steps"]): r for r in results}
    rows = []
    for dataset, proposer in keys:
        cells = [by.get((dataset, proposer, k), {}).get("accept_length") for k in steps]
        prompts = next(
            r["sequences"] for r in results if (r["dataset"], proposer_label(r)) == (dataset, proposer)
        )
        rows.append([dataset, proposer, str(prompts), *cells])
    return markdown_table(["dataset", "proposer", "prompts", *[f"{k} steps" for k in steps]], rows)


def acceptance_by_group(per_prompt: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Acceptance length per (dataset, group, proposer, steps) from the per-prompt rows that carry a group
    (MT-Bench's categories), computed as the decoder's figure is: verify tokens (each sequence's prefill
    token left out) per verify forward."""
    sums: dict[tuple[str, str, str, int], list[int]] = {}
    for r in per_prompt:
        if not r.get("group"):
            continue
        acc = sums.setdefault((r["dataset"], r["group"], proposer_label(r), r["num_steps"]), [0, 0, 0])
        acc[0] += 1
        acc[1] += max(0, r["completion_tokens"] - 1)
        acc[2] += r["spec_verify_ct"]
    return [
        {"dataset": d, "group": g, "proposer": p, "num_steps": k, "prompts": n, "verify_tokens": tokens,
         "spec_verify_ct": verify, "accept_length": round(tokens / verify, 4) if verify else 1.0}
        for (d, g, p, k), (n, tokens, verify) in sorted(sums.items())
    ]  # fmt: skip


def group_table(by_group: list[dict[str, Any]]) -> list[str]:
    """Acceptance length per group (rows) and proposer x steps (columns), one table per dataset."""
    lines: list[str] = []
    for dataset in sorted({r["dataset"] for r in by_group}):
        rows = [r for r in by_group if r["dataset"] == dataset]
        columns = sorted({(proposer_label(r), r["num_steps"]) for r in rows})
        cell = {(r["group"], proposer_label(r), r["num_steps"]): r for r in rows}
        groups = sorted({r["group"] for r in rows})
        body = [
            [g, str(next(r["prompts"] for r in rows if r["group"] == g))]
            + [cell.get((g, p, k), {}).get("accept_length") for p, k in columns]
            for g in groups
        ]
        lines += [f"### {dataset}", ""]
        lines += markdown_table(["group", "prompts", *[f"{p} k{k}" for p, k in columns]], body) + [""]
    return lines


def conditional_table(results: list[dict[str, Any]]) -> list[str]:
    """P(draft j accepted | drafts before it accepted), per position."""
    width = max((r["num_steps"] for r in results), default=0)
    rows = []
    for r in results:
        cond = list(r["conditional_acceptance"]) + [None] * (width - len(r["conditional_acceptance"]))
        rows.append([r["dataset"], proposer_label(r), str(r["num_steps"]), *cond])
    return markdown_table(["dataset", "proposer", "steps", *[f"pos {j + 1}" for j in range(width)]], rows)


def diagnosis_section(diagnosis: dict[str, dict[str, Any]], results: list[dict[str, Any]]) -> list[str]:
    """Measured vs teacher-forced acceptance and per-token accuracy (aerie.evaluate.diagnose)."""
    rows = []
    by_position: list[str] = []
    by_vocab: list[str] = []
    for dataset, d in diagnosis.items():
        if not d.get("rounds"):
            continue
        k = d["num_steps"]
        measured = next(
            (
                r["accept_length"]
                for r in results
                if (r["dataset"], r["num_steps"]) == (dataset, k)
                and proposer_label(r) == r["proposer"] != PROMPT_LOOKUP
            ),
            None,
        )
        acc = " / ".join(f"{x:.2f}" for x in d["per_token_accuracy"])
        rows.append(
            [dataset, str(k), measured, d["simulated_accept_length"], d.get("vocab_bound_accept_length"), acc]
        )
        cells = ", ".join(f"{span}: {x:.2f}" for span, x in d["step0_accuracy_by_answer_position"].items())
        by_position.append(f"- {dataset}: {cells}")
        if d.get("vocab_coverage_by_size"):  # diagnoses written before it was measured have none
            sizes = ", ".join(f"{int(n):,}: {x:.1%}" for n, x in d["vocab_coverage_by_size"].items())
            by_vocab.append(f"- {dataset}: {sizes}")
    if not rows:
        return []
    vocab_lines = [
        "Share of the target's answers inside a draft vocabulary of each size, chosen as training chose "
        "this drafter's (the most frequent supervised tokens; a token outside is never drafted):",
        "",
        *by_vocab,
        "",
    ]
    return [
        "## Where acceptance is lost (EAGLE-3, teacher-forced on the target's own answers)",
        "",
        "The drafter's training-time-test forward replayed on each answer, walked in rounds as the decoder "
        "walks it. Simulated = measured: serving drafts what training taught, so a low figure is the "
        "drafter's accuracy; a gap is a train/serve mismatch (positions, aux layers, vocab map, draft cache).",
        "",
        "The vocabulary bound is the simulated figure had every answer token outside the draft vocabulary "
        "been drafted right: the most a larger draft vocabulary could give back.",
        "",
        *markdown_table(
            [
                "dataset",
                "steps",
                "measured",
                "simulated",
                "vocabulary bound",
                "per-token accuracy by draft step",
            ],
            rows,
        ),
        "",
        "Step-0 accuracy by position in the answer (tokens):",
        "",
        *by_position,
        "",
        *(vocab_lines if by_vocab else []),
    ]


def reasoning_section(results: list[dict[str, Any]]) -> list[str]:
    """A thinking target's acceptance on its reasoning and on its answers (rounds classified by where
    they start, `aerie.evaluate.reasoning_split`); nothing for another target."""
    split = [r for r in results if "reasoning" in r]
    if not split:
        return []
    lines = [
        "## Reasoning and answer",
        "",
        "Verify rounds that start inside the think block are reasoning, the others answer.",
        "",
        "| dataset | proposer | steps | T | reasoning τ | rounds | answer τ | rounds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in split:
        lines.append(
            f"| {r['dataset']} | {r['proposer']} | {r['num_steps']} | {r.get('temperature') or 0:g} | "
            f"{_num(r['reasoning']['accept_length'])} | {r['reasoning']['rounds']} | "
            f"{_num(r['answer']['accept_length'])} | {r['answer']['rounds']} |"
        )
    return [*lines, ""]


def evaluation_markdown(report: dict[str, Any]) -> str:
    results = report["results"]
    by_group = report.get("by_group") or []  # reports written before it have none
    lines = [
        f"# Evaluation: {report['target']['name']} with drafter {report['drafter']['prefix']}",
        "",
        "Greedy speculative decoding, one target forward verifies a chain of `steps` drafts. "
        "**Acceptance length** = tokens per target verify forward, the target's bonus token included "
        "(1.0 = no draft ever accepted; steps + 1 = every draft accepted). SGLang's `spec_accept_length` "
        "(completion tokens / verify forwards, counting the prefill's token too) is in report.json.",
        "",
        "## Acceptance length",
        "",
        *acceptance_table(results),
        "",
        "## Conditional acceptance per draft position",
        "",
        *conditional_table(results),
        "",
        *(["## Acceptance length by category", "", *group_table(by_group)] if by_group else []),
        *reasoning_section(results),
        *position_table(results),
        *diagnosis_section(report.get("diagnosis") or {}, results),
        "## Setup",
        "",
    ]
    for name, info in report["datasets"].items():
        lines.append(
            f"- {name}: {info['prompts']} prompts, mean {info['mean_prompt_tokens']:.0f} prompt tokens"
        )
    for r in results:
        if r.get("draft_vocab_coverage") is not None and r["num_steps"] == min(
            x["num_steps"] for x in results
        ):
            lines.append(
                f"- {r['dataset']}: {r['draft_vocab_coverage']:.1%} of the target's output tokens are in the "
                "draft vocabulary (the rest can never be drafted)"
            )
    expected = report["drafter"].get("expected_accept_length")
    rounds = report["drafter"].get("trainer_accept_length_rounds")
    lines += [
        f"- max new tokens {report['config']['max_new_tokens']}, device {report['device']}, dtype {report['dtype']}",
        f"- the trainer's held-out acceptance length walked in rounds: {_num(rounds)} (per-position estimate "
        f"{_num(expected)}, which runs high: rounds start after a rejected draft, where drafting is hardest)",
        f"- outputs identical across proposers and step counts (lossless check): "
        f"{report['agreement']['identical']}/{report['agreement']['compared']} prompt runs",
    ]
    if report["agreement"]["identical"] != report["agreement"]["compared"]:
        lines.append(
            "  (different outputs for the same prompt come from floating-point differences between a "
            "k-token verify forward and another batch shape — bf16 on GPU — not from the algorithm, "
            "which the lossless test checks in fp32)"
        )
    return "\n".join(lines) + "\n"


def plot_acceptance(results: list[dict[str, Any]], path: Path) -> Path:
    """One column per dataset, a line per proposer and step count: conditional acceptance per draft
    position (top) and acceptance length by position in the output (bottom; `aerie.evaluate.positions`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    cols = max(1, len(datasets))
    fig, axes = plt.subplots(2, cols, figsize=(6 * cols, 8), squeeze=False)
    for col, dataset in enumerate(datasets):
        ax, deep = axes[0][col], axes[1][col]
        for r in (r for r in results if r["dataset"] == dataset):
            cond = r["conditional_acceptance"]
            xs = [j + 1 for j, c in enumerate(cond) if c is not None]
            ys = [c for c in cond if c is not None]
            style = "--" if r["proposer"] == PROMPT_LOOKUP else "-"
            label = f"{proposer_label(r)} k={r['num_steps']} (τ={r['accept_length']:.2f})"
            ax.plot(xs, ys, style, marker="o", label=label)
            by_position = r.get("acceptance_by_position") or {}
            points = [
                (i, b["accept_length"]) for i, b in enumerate(by_position.values()) if b["accept_length"]
            ]
            if points:
                deep.plot([i for i, _ in points], [a for _, a in points], style, marker="o", label=label)
        ax.set_title(f"{dataset}: acceptance per draft position")
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(accepted | previous accepted)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        deep.set_title(f"{dataset}: acceptance length by position in the output")
        deep.set_xticks(range(len(NAMES)), list(NAMES))
        deep.set_xlabel("output tokens (where the verify round starts)")
        deep.set_ylabel("tokens per verify round")
        deep.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with writing(path, EvaluationError):
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
