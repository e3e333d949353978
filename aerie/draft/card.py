"""The drafter card: `README.md` in every exported drafter directory, as model hubs render it.

YAML front matter (`base_model`, `library_name`, `tags`) and a body written from the stage manifests,
never by hand: the target, the data, the recipe, the acceptance per prompt set and draft position, the
served speed-up per concurrency level when the drafter was served, and the lines that serve it (SGLang
always; vLLM only where the directory holds vLLM's layout, `vllm/config.json`). Each stage writes what
it knows: the train stage's export (target, data, recipe, held-out acceptance), the evaluate stage
(offline acceptance against prompt lookup), the deploy stage for the promoted copy (served figures).

    card_markdown(CardFacts(...)) -> str          the card
    write_card(store, drafter_dir_key, facts)     README.md into a drafter directory of the store
    update_card(store, train_prefix, ...)         the same from the manifests in the store (evaluate, deploy)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aerie.errors import StoreError
from aerie.families import family
from aerie.manifest import load_manifest
from aerie.store import ArtifactStore

CARD = "README.md"
VLLM_CONFIG = "vllm/config.json"  # vLLM's layout beside SGLang's (aerie.draft.vllm_export)
PROMPT_LOOKUP = "prompt_lookup"
_DEFAULT_STEPS = 3  # the served chain length when no deployment chose one (the deploy stage's default)


@dataclass(frozen=True)
class CardFacts:
    """The manifests a card is written from (a later stage's may be missing: not run yet)."""

    train: dict[str, Any]  # the train stage's manifest (or the body it is about to write)
    drafter_dir: str  # where the drafter directory is: a local path or the store's URI
    corpus: dict[str, Any] | None = None  # the merge stage's manifest
    evaluation: dict[str, Any] | None = None  # the evaluate stage's manifest
    served: dict[str, Any] | None = None  # the deploy stage's report (rows, promotion, num_steps)
    vllm: bool = False  # the directory holds vLLM's layout


def write_card(store: ArtifactStore, drafter_dir_key: str, facts: CardFacts) -> str:
    """README.md into the drafter directory at `drafter_dir_key`; returns its key."""
    key = f"{drafter_dir_key}/{CARD}"
    store.put_bytes(key, card_markdown(facts).encode())
    return key


def update_card(
    store: ArtifactStore,
    train_prefix: str,
    *,
    evaluation_prefix: str | None = None,
    served: dict[str, Any] | None = None,
    drafter_dir_key: str | None = None,
) -> str:
    """The card of the drafter the train stage at `train_prefix` made, from the manifests in the store,
    into `drafter_dir_key` (default: that stage's own drafter directory); returns its key."""
    train = load_manifest(store, train_prefix)
    evaluation = load_manifest(store, evaluation_prefix) if evaluation_prefix else None
    dir_key = drafter_dir_key or f"{train_prefix}/drafter"
    facts = CardFacts(
        train=train,
        drafter_dir=drafter_location(store, dir_key),
        corpus=_manifest_or_none(store, (evaluation or {}).get("corpus") or train.get("corpus")),
        evaluation=evaluation,
        served=served,
        vllm=store.exists(f"{dir_key}/{VLLM_CONFIG}"),
    )
    return write_card(store, dir_key, facts)


def _manifest_or_none(store: ArtifactStore, prefix: str | None) -> dict[str, Any] | None:
    """A manifest the card can do without (a drafter trained before its corpus was recorded)."""
    if not prefix:
        return None
    try:
        return load_manifest(store, prefix)
    except StoreError:
        return None


def drafter_location(store: ArtifactStore, drafter_dir_key: str) -> str:
    """A directory SGLang can be pointed at: the local path of a local store, else the store's URI."""
    local = store.local_path(drafter_dir_key)
    return str(local) if local is not None else store.uri(drafter_dir_key)


def card_markdown(facts: CardFacts) -> str:
    train = facts.train
    target = train.get("target", {})
    name = family(train.get("family", "eagle3"))
    lines = [
        *_front_matter(target.get("name", "unknown"), name.name),
        f"# {name.name.upper()} drafter for {target.get('name', 'its target')}",
        "",
        f"A speculative-decoding drafter trained by aerie (run `{train.get('run', '?')}`). It proposes "
        "tokens that the target verifies, so the served outputs are the target's own; it pays when the "
        "target accepts enough of them. Written from the stage manifests: do not edit by hand.",
        "",
        *_target_section(train),
        *_data_section(facts.corpus, train),
        *_recipe_section(train),
        *_acceptance_section(train, facts.evaluation),
        *_served_section(facts.served),
        *_serve_section(facts, name.served_algorithm),
        *_provenance_section(facts),
    ]
    return "\n".join(lines).rstrip() + "\n"


def _front_matter(target: str, family_name: str) -> list[str]:
    tags = ["speculative-decoding", family_name, "draft-model", "aerie"]
    return [
        "---",
        f"base_model: {json.dumps(target)}",
        "library_name: sglang",
        "tags:",
        *[f"  - {t}" for t in tags],
        "---",
        "",
    ]


def _target_section(train: dict[str, Any]) -> list[str]:
    target, vocab = train.get("target", {}), train.get("vocab", {})
    layers = train.get("layers", {}).get("output_convention")
    config = train.get("drafter_config", {})
    rows = [
        ("model", f"`{target.get('name')}`"),
        ("revision", f"`{target.get('revision')}`"),
        ("target layers read (output of)", _num(layers)),
        ("drafter architecture", ", ".join(config.get("architectures", [])) or None),
        ("draft vocabulary", _num(vocab.get("draft_vocab_size"))),
        ("supervised tokens it covers", _pct(vocab.get("vocab_coverage"))),
    ]
    kept = [r for r in rows if r[1] not in (None, "–", "`None`")]
    return ["## Target", "", *_table(["", ""], kept), ""]


def _data_section(corpus: dict[str, Any] | None, train: dict[str, Any]) -> list[str]:
    lines = ["## Data", ""]
    if corpus is None:
        return [*lines, f"The corpus of `{train.get('corpus', '?')}` (its manifest was not found).", ""]
    figures = corpus.get("figures", {})
    sources = sorted({s for split in corpus.get("splits", {}).values() for s in split.get("by_source", {})})
    rows = [
        ("conversations (records)", _num(figures.get("records"))),
        ("tokens", _num(figures.get("tokens"))),
        ("supervised (assistant) tokens", _num(figures.get("supervised_tokens"))),
        (
            "train / held-out records",
            f"{_num(figures.get('train_records'))} / {_num(figures.get('eval_records'))}",
        ),
        ("sources", ", ".join(f"`{s}`" for s in sources) or None),
        ("answers", "the target's own, generated again turn by turn (aerie's generate stage)"),
        ("corpus", f"`{corpus.get('run', '')}/merge/{corpus.get('key', '')}`"),
    ]
    return [*lines, *_table(["", ""], [r for r in rows if r[1] is not None]), ""]


def _recipe_section(train: dict[str, Any]) -> list[str]:
    training = train.get("training", {})
    cfg = training.get("config", {})
    figures = train.get("figures", {})
    rows = [
        ("epochs", _num(cfg.get("epochs"))),
        ("optimizer steps", _num(training.get("total_steps"))),
        ("trained tokens", _num(training.get("tokens"))),
        ("peak learning rate (AdamW, cosine)", _num(cfg.get("lr"))),
        ("packed tokens per step", _num(cfg.get("batch_tokens"))),
        # train.drafter.ttt_length (a manifest written before it moved there: train.ttt_length).
        (
            "training-time-test unroll",
            _num((cfg.get("drafter") or {}).get("ttt_length", cfg.get("ttt_length"))),
        ),
        ("max sample length", _num(cfg.get("max_length"))),
        ("seed", _num(cfg.get("seed"))),
        ("best step (held-out acceptance)", _num(figures.get("best_step"))),
        ("training wall time (s)", _num(training.get("wall_s"))),
    ]
    return ["## Recipe", "", *_table(["", ""], [r for r in rows if r[1] != "–"]), ""]


def _acceptance_section(train: dict[str, Any], evaluation: dict[str, Any] | None) -> list[str]:
    best = train.get("best", {})
    lines = [
        "## Acceptance",
        "",
        "Acceptance length: tokens per target verify forward, the target's bonus token included (1.0 = no "
        "draft ever accepted).",
        "",
        f"- held-out during training: {_num(best.get('accept_length_rounds'))} walked in rounds as the "
        f"decoder walks them (per-position estimate {_num(best.get('accept_length'))})",
    ]
    eval_acc = train.get("final", {}).get("eval", {}).get("acc")
    if eval_acc:
        lines.append(f"- held-out per-position draft accuracy (last evaluation): {_num(eval_acc)}")
    lines.append("")
    if evaluation is None:
        return [*lines, "Not evaluated yet: the evaluate stage adds acceptance per prompt set here.", ""]
    results = evaluation.get("results", [])
    width = max((r.get("num_steps", 0) for r in results), default=0)
    rows = []
    for r in results:
        cond = list(r.get("conditional_acceptance") or [])
        cond += [None] * (width - len(cond))
        proposer = r.get("proposer", "?") + (f" (t={r['temperature']:g})" if r.get("temperature") else "")
        rows.append([r.get("dataset"), proposer, r.get("num_steps"), r.get("accept_length"), *cond])
    header = ["prompt set", "proposer", "steps", "accept length", *[f"pos {j + 1}" for j in range(width)]]
    agreement = evaluation.get("agreement", {})
    return [
        *lines,
        "Offline, lossless speculative decoding against prompt lookup (`pos j`: the share of drafts at "
        "position j accepted when the ones before it were):",
        "",
        *_table(header, rows),
        "",
        f"Outputs identical across proposers (the lossless check): {agreement.get('identical')}/"
        f"{agreement.get('compared')}.",
        "",
    ]


def _served_section(served: dict[str, Any] | None) -> list[str]:
    if served is None:
        return []
    rows_in = served.get("rows", [])
    base = {r["concurrency"]: r for r in rows_in if r.get("server") == "baseline"}
    rows = []
    for r in rows_in:
        if r.get("server") != "speculative":
            continue
        b = base.get(r["concurrency"], {})
        rows.append(
            [
                r["concurrency"],
                b.get("output_tokens_per_s"),
                r.get("output_tokens_per_s"),
                f"{_num(r.get('speedup'))}x",
                r.get("accept_length"),
            ]
        )
    promotion = served.get("promotion", {})
    header = ["concurrency", "baseline tokens/s", "speculative tokens/s", "speed-up", "accept length"]
    return [
        "## Served speed-up",
        "",
        f"Served by `{served.get('backend')}` with {served.get('num_steps')} draft steps, "
        f"{served.get('num_prompts')} MT-Bench prompts, {served.get('max_new_tokens')} new tokens each:",
        "",
        *_table(header, rows),
        "",
        f"Promotion: {promotion.get('reason')}.",
        "",
    ]


def _serve_section(facts: CardFacts, algorithm: str) -> list[str]:
    target = facts.train.get("target", {}).get("name", "<target>")
    steps = int((facts.served or {}).get("num_steps") or _DEFAULT_STEPS)
    sglang = [
        f"python -m sglang.launch_server --model-path {target} \\",
        f"    --speculative-algorithm {algorithm} --speculative-draft-model-path {facts.drafter_dir}",
    ]
    if algorithm == "EAGLE3":
        sglang[-1] += " \\"
        sglang.append(
            f"    --speculative-num-steps {steps} --speculative-eagle-topk 1 "
            f"--speculative-num-draft-tokens {steps + 1}"
        )
    lines = ["## Serving", "", "SGLang:", "", "```bash", *sglang, "```", ""]
    if facts.vllm:
        spec = {"method": "eagle3", "model": f"{facts.drafter_dir}/vllm", "num_speculative_tokens": steps}
        lines += ["vLLM (the `vllm/` folder):", "", "```bash"]
        lines += [f"vllm serve {target} --speculative-config '{json.dumps(spec)}'", "```", ""]
    return lines


def _provenance_section(facts: CardFacts) -> list[str]:
    stages = [("train", facts.train), ("merge", facts.corpus), ("evaluate", facts.evaluation)]
    rows = [
        [stage, f"`{m.get('run')}/{stage}/{m.get('key')}`", m.get("aerie_version")]
        for stage, m in stages
        if m is not None and m.get("key")
    ]
    if not rows:
        return []
    return ["## Provenance", "", *_table(["stage", "output", "aerie"], rows), ""]


def _table(header: list[str], rows: list[Any]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_num(v) if not isinstance(v, str) else v for v in row) + " |" for row in rows]
    return out


def _num(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, list):
        return ", ".join(_num(v) for v in value)
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _pct(value: Any) -> str | None:
    return f"{value:.1%}" if isinstance(value, int | float) else None
