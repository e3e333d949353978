"""The evaluate stage: acceptance of the trained drafter beside prompt lookup, on MT-Bench and held-out.

    <run>/evaluate/<key>/parts/<dataset>-<proposer>-k<steps>.json   one finished measurement each
    <run>/evaluate/<key>/per_prompt.jsonl                          per prompt: tokens, verify forwards
    <run>/evaluate/<key>/report.json, report.md, acceptance.png
    <run>/evaluate/<key>/manifest.json                             written last

Every (dataset, proposer, steps) measurement is written as soon as it is done, so a re-run after a
crash measures only what is missing. The same decoder measures both proposers, and every measurement
decodes the same prompts: their outputs must agree (the decoder is lossless), which is counted.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aerie.draft.card import update_card
from aerie.errors import EvaluationError
from aerie.evaluate.config import PROMPT_LOOKUP, EvaluateConfig
from aerie.evaluate.drafter_files import fetch_drafter
from aerie.evaluate.positions import PositionCounts
from aerie.evaluate.prompts import ALL_ROWS, EvalPrompt, heldout_prompts, prompt_set, prompt_tokenizer
from aerie.evaluate.reasoning_split import KINDS, SplitCounts, format_key, prompt_template, reader_for
from aerie.evaluate.report import ACCEPTANCE_PNG, acceptance_by_group, evaluation_markdown, plot_acceptance
from aerie.families import DEFAULT, Family
from aerie.manifest import StageDir, StageResult, load_manifest, stage_key
from aerie.progress import ProgressFn
from aerie.stage import WorkContext
from aerie.store import ArtifactStore
from aerie.targets import TargetInfo, resolve_device, resolve_dtype
from aerie.trackers import NO_TRACKING, Tracking
from aerie.workdirs import work_dir

if TYPE_CHECKING:
    from aerie.engine.speculative.decoder import Proposer

STAGE = "evaluate"


def key_of(cfg: EvaluateConfig, target: TargetInfo, drafter: StageResult, corpus: StageResult) -> str:
    upstream = [drafter.manifest_sha256, corpus.manifest_sha256, target.revision]
    # A subset of MT-Bench was its first questions before it was spread over the categories: a result
    # cached from then measured other prompts. All 80 are the same prompts either way (same key).
    spread = ["mtbench-spread-over-categories"] if cfg.mtbench_questions is not None else []
    return stage_key(STAGE, cfg, upstream + spread + format_key(cfg.prompt_format))


def run(
    cfg: EvaluateConfig,
    ctx: WorkContext,
    *,
    drafter: StageResult,
    corpus: StageResult,
    family: Family,
    tracking: Tracking = NO_TRACKING,
) -> StageResult:
    """Measure acceptance length (and per-position acceptance) for every dataset x proposer x steps,
    into `ctx.stage_dir` (keyed by `key_of` over these inputs); `drafter` is a drafter of `family`, the run's."""
    stage_dir, store, target, progress = ctx.stage_dir, ctx.store, ctx.target, ctx.progress
    if (cached := stage_dir.cached_result()) is not None:
        return cached
    _check(cfg)
    check_proposers(cfg, family)
    progress(0.0, "loading prompts")
    datasets, held_skipped = _datasets(cfg, store, target, corpus)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    with work_dir("aerie-eval-") as tmp:
        models = _Models(
            lambda: _load(cfg, store, target, (family, drafter), Path(tmp), (device, dtype)),
            f"{target.name} on {device}",
        )
        measured = _measure_all(cfg, stage_dir, models, target, datasets, progress)
        diagnosis = _diagnose_all(
            cfg, stage_dir, models, target, corpus, datasets, measured.answers, progress
        )
        agreement = _agreement(measured.per_prompt)
        body = {
            "target": {"name": target.name, "revision": target.revision},
            "drafter": _drafter_record(store, drafter),
            "config": cfg.model_dump(mode="json"),
            "device": device,
            "dtype": str(dtype).removeprefix("torch."),
            "datasets": {
                name: {
                    "prompts": len(prompts),
                    "mean_prompt_tokens": sum(len(p.input_ids) for p in prompts) / max(1, len(prompts)),
                }
                for name, prompts in datasets.items()
            },
            "heldout_skipped": held_skipped,
            "results": measured.results,
            "by_group": acceptance_by_group(measured.per_prompt),
            "agreement": agreement,
            "diagnosis": diagnosis,
        }
        store.put_file(
            stage_dir.path(ACCEPTANCE_PNG), plot_acceptance(measured.results, Path(tmp) / ACCEPTANCE_PNG)
        )
    per_prompt = "".join(json.dumps(r) + "\n" for r in measured.per_prompt)
    store.put_bytes(stage_dir.path("per_prompt.jsonl"), per_prompt.encode())
    store.put_bytes(stage_dir.path("report.json"), json.dumps(body, indent=2).encode())
    store.put_bytes(stage_dir.path("report.md"), evaluation_markdown(body).encode())
    progress(1.0, "report written")
    result = stage_dir.finish(
        {
            "target": {"name": target.name, "revision": target.revision},
            "drafter": drafter.prefix,
            "corpus": corpus.prefix,
            "config": cfg.model_dump(mode="json"),
            "results": measured.results,
            "agreement": agreement,
            "files": {
                "report": "report.json",
                "markdown": "report.md",
                "plot": ACCEPTANCE_PNG,
                "per_prompt": "per_prompt.jsonl",
            },
            "figures": _figures(measured.results, datasets, agreement),
        }
    )
    # The drafter's card gains the acceptance per prompt set; the trackers get the headline figures.
    update_card(store, drafter.prefix, evaluation_prefix=stage_dir.prefix)
    params = {"evaluate": cfg.model_dump(mode="json"), "provenance": {"drafter": drafter.prefix}}
    tracking.report(stage_dir, result.figures, params)
    return result


def _check(cfg: EvaluateConfig) -> None:
    if not cfg.num_steps or any(k < 1 for k in cfg.num_steps):
        raise EvaluationError(f"evaluate.num_steps must list chain lengths >= 1, got {cfg.num_steps}")
    if not cfg.proposers:
        raise EvaluationError("evaluate.proposers is empty: nothing to measure")


def _datasets(
    cfg: EvaluateConfig, store: ArtifactStore, target: TargetInfo, corpus: StageResult
) -> tuple[dict[str, list[EvalPrompt]], dict[str, int]]:
    """The prompts by dataset (held-out only where the corpus has some), and the held-out samples
    skipped, by reason."""
    fmt = cfg.prompt_format
    tokenizer = prompt_tokenizer(target.load_tokenizer(), prompt_template(fmt), fmt.chat_template_kwargs)
    datasets: dict[str, list[EvalPrompt]] = {}
    held_skipped: dict[str, int] = {}
    for spec in cfg.prompt_sets():
        if spec.kind == "heldout":
            held, held_skipped = heldout_prompts(
                store, corpus, spec.limit or ALL_ROWS, cfg.max_prompt_tokens, spec.name
            )
            if held:
                datasets[spec.name] = held
        else:
            datasets[spec.name] = prompt_set(tokenizer, spec, cfg.max_prompt_tokens)
    return datasets, held_skipped


class _Models:
    """The target (and drafter), loaded on first use: a re-run whose parts are all stored loads none."""

    def __init__(self, load: Callable[[], dict[str, Any]], label: str) -> None:
        self._load = load
        self.label = label  # what is loaded where, for progress
        self._loaded: dict[str, Any] | None = None

    @property
    def loaded(self) -> bool:
        return self._loaded is not None

    def get(self) -> dict[str, Any]:
        if self._loaded is None:
            self._loaded = self._load()
        return self._loaded


@dataclass
class _Measured:
    results: list[dict[str, Any]] = field(default_factory=list)
    per_prompt: list[dict[str, Any]] = field(default_factory=list)
    answers: dict[str, dict[str, list[int]]] = field(
        default_factory=dict
    )  # the diagnosed drafter's longest greedy run


def _measure_all(
    cfg: EvaluateConfig,
    stage_dir: StageDir,
    models: _Models,
    target: TargetInfo,
    datasets: dict[str, list[EvalPrompt]],
    progress: ProgressFn,
) -> _Measured:
    """Every (dataset, proposer, steps) measurement: read from its stored part, or measured and stored."""
    store = stage_dir.store
    plan = [
        (name, proposer, k, t)
        for name in datasets
        for t in cfg.temperatures
        for proposer in cfg.proposers
        for k in cfg.num_steps
    ]
    total = sum(len(datasets[name]) for name, *_ in plan)
    done = 0
    out = _Measured()
    for name, proposer_name, k, temperature in plan:
        setting = f"{name}-{proposer_name}-k{k}" + (f"-t{temperature:g}" if temperature else "")
        part_key = stage_dir.path(f"parts/{setting}.json")
        if store.exists(part_key):
            part = json.loads(store.get_bytes(part_key))
        else:
            if not models.loaded:
                progress(done / total, f"loading {models.label}")

            def report(batch_done: int, base: int = done, label: str = setting) -> None:
                progress((base + batch_done) / total, label)

            part = measure_setting(
                cfg, models.get(), target, name, datasets[name], proposer_name, (k, temperature), report
            )
            store.put_bytes(part_key, json.dumps(part).encode())
        done += len(datasets[name])
        out.results.append(part["result"])
        out.per_prompt += part["per_prompt"]
        if k == max(cfg.num_steps) and not temperature and "answers" in part:
            out.answers[name] = part["answers"]
        progress(done / total, f"{setting}: τ={part['result']['accept_length']:.2f}")
    return out


def _diagnose_all(
    cfg: EvaluateConfig,
    stage_dir: StageDir,
    models: _Models,
    target: TargetInfo,
    corpus: StageResult,
    datasets: dict[str, list[EvalPrompt]],
    answers: dict[str, dict[str, list[int]]],
    progress: ProgressFn,
) -> dict[str, dict[str, Any]]:
    """The teacher-forced diagnosis of each dataset the drafter answered (parts written before answers
    were kept have none: no diagnosis then), read from its stored part or made and stored."""
    store = stage_dir.store
    diagnosis: dict[str, dict[str, Any]] = {}
    counts = None  # the corpus's token counts: read once, and only if a diagnosis has to run
    for name in answers:
        part_key = stage_dir.path(f"parts/{name}-diagnosis.json")
        if not store.exists(part_key):
            progress(1.0, f"{name}: teacher-forced diagnosis")
            loaded = models.get()
            found = _diagnose(loaded, datasets[name], answers[name], max(cfg.num_steps), cfg.max_new_tokens)
            if counts is None:
                counts = _token_counts(store, corpus, target)
            found["vocab_coverage_by_size"] = _vocab_what_if(counts, loaded, answers[name])
            store.put_bytes(part_key, json.dumps(found).encode())
        diagnosis[name] = json.loads(store.get_bytes(part_key))
    return diagnosis


def _drafter_record(store: ArtifactStore, drafter: StageResult) -> dict[str, Any]:
    """Where the drafter is, and the acceptance its trainer expected of it."""
    trainer = load_manifest(store, drafter.prefix).get("figures", {})
    return {
        "prefix": f"{drafter.prefix}/drafter",
        "expected_accept_length": trainer.get("accept_length"),
        "trainer_accept_length_rounds": trainer.get("accept_length_rounds"),
    }


def _load(
    cfg: EvaluateConfig,
    store: ArtifactStore,
    target: TargetInfo,
    drafter: tuple[Family, StageResult],
    tmp: Path,
    placed: tuple[str, Any],
) -> dict[str, Any]:
    device, dtype = placed
    model = target.load_model(device, str(dtype).removeprefix("torch."))
    loaded: dict[str, Any] = {"model": model}
    if measures_drafter(cfg):
        drafting, result = drafter
        local = fetch_drafter(store, result, tmp / "drafter")
        loaded.update(load_drafter_of(drafting, target, local, device, dtype))
    return loaded


def measures_drafter(cfg: EvaluateConfig) -> bool:
    """Whether `cfg.proposers` lists the trained drafter (anything but prompt lookup)."""
    return any(p != PROMPT_LOOKUP for p in cfg.proposers)


def check_proposers(cfg: EvaluateConfig, drafting: Family) -> None:
    """The drafter `cfg.proposers` lists is a `drafting` one: the one drafter measured is the run's."""
    other = [p for p in cfg.proposers if p not in (PROMPT_LOOKUP, drafting.name)]
    if other:
        raise EvaluationError(
            f"evaluate.proposers lists {other}, but the drafter measured is a {drafting.name} one: "
            f"list {drafting.name} (or {DEFAULT}, which stands for the run's family) and {PROMPT_LOOKUP}"
        )


def load_drafter_of(
    drafting: Family, target: TargetInfo, path: Path, device: str, dtype: Any
) -> dict[str, Any]:
    """The drafter at `path`, read by its family's loader (`TargetError` when the directory holds
    another family's drafter, naming it), and the family its proposer comes from."""
    return {"drafter": drafting.loader.load()(path, target, device=device, dtype=dtype), "family": drafting}


def make_proposer(
    name: str, cfg: EvaluateConfig, loaded: dict[str, Any]
) -> tuple[Proposer, list[int] | None]:
    """A fresh proposer and the target hidden states it reads (HF hidden_states indices): prompt lookup,
    or the loaded drafter's, from its family (`load_drafter_of`)."""
    if name == PROMPT_LOOKUP:
        from aerie.engine.speculative.prompt_lookup import PromptLookupProposer

        return PromptLookupProposer(cfg.prompt_lookup.max_ngram, cfg.prompt_lookup.min_ngram), None
    drafting: Family | None = loaded.get("family")
    if drafting is None or name != drafting.name:
        loaded_name = drafting.name if drafting else "none"
        raise EvaluationError(f"proposer {name!r} is not the loaded drafter's family ({loaded_name})")
    proposer = drafting.proposer.load()(loaded["drafter"])
    return proposer, proposer.aux_layers


def measure_setting(
    cfg: EvaluateConfig,
    loaded: dict[str, Any],
    target: TargetInfo,
    dataset: str,
    prompts: list[EvalPrompt],
    proposer_name: str,
    setting: tuple[int, float],
    report: Callable[[int], None],
) -> dict[str, Any]:
    """Decode `prompts` in batches with a fresh proposer per batch at `setting` = (chain length,
    temperature); the stats and a row per prompt. A sampled batch draws from a seed of its own
    (dataset, setting and first prompt), so a resumed evaluation measures what an unbroken one would."""
    k, temperature = setting
    from aerie.engine.speculative.decoder import SpecDecoder, SpecStats

    stats = SpecStats(k)
    rows: list[dict[str, Any]] = []
    answers: dict[str, list[int]] = {}
    # Where acceptance is lost: a target token outside the draft vocabulary can never be drafted.
    drafting: Family | None = loaded.get("family") if proposer_name != PROMPT_LOOKUP else None
    in_vocab = loaded["drafter"].t2d.cpu() if drafting and drafting.vocabulary == "draft" else None
    covered = 0
    # A thinking target's rounds by kind (reasoning or answer): the reader is made once per loaded target.
    if "reasoning_reader" not in loaded:
        loaded["reasoning_reader"] = reader_for(cfg.prompt_format, target)
    reader = loaded["reasoning_reader"]
    split = SplitCounts()
    positions = PositionCounts()
    started = time.perf_counter()
    for start in range(0, len(prompts), cfg.batch_size):
        batch = prompts[start : start + cfg.batch_size]
        proposer, aux_layers = make_proposer(proposer_name, cfg, loaded)
        decoder = SpecDecoder(
            loaded["model"],
            proposer,
            num_steps=k,
            eos_token_ids=target.eos_token_ids,
            aux_layers=aux_layers,
            temperature=temperature,
            seed=_batch_seed(dataset, k, temperature, start),
        )
        outputs = decoder.generate([p.input_ids for p in batch], cfg.max_new_tokens)
        for prompt, out in zip(batch, outputs, strict=True):
            stats.add(out)
            positions.add(out)
            if reader is not None:
                split.add(reader.kinds(prompt.input_ids, out), out)
            answers[prompt.id] = out.output_ids
            if in_vocab is not None and out.output_ids:
                covered += int(in_vocab[out.output_ids].sum())
            rows.append(
                {
                    "dataset": prompt.dataset,
                    "id": prompt.id,
                    "group": prompt.group,
                    "proposer": proposer_name,
                    "num_steps": k,
                    "temperature": temperature,
                    "prompt_tokens": len(prompt.input_ids),
                    "completion_tokens": out.completion_tokens,
                    "spec_verify_ct": out.verify_ct,
                    "finish_reason": out.finish_reason,
                    "accepted": out.accepted,
                    "output_sha": _digest(out.output_ids),
                }
            )
        report(start + len(batch))
    stats.seconds = time.perf_counter() - started
    result: dict[str, Any] = {
        "dataset": dataset,
        "proposer": proposer_name,
        "temperature": temperature,
        **stats.to_dict(),
        "acceptance_by_position": positions.to_dict(),
    }
    if reader is not None:
        result.update(split.to_dict())
    if in_vocab is not None:
        result["draft_vocab_coverage"] = round(covered / max(1, stats.completion_tokens), 4)
    part: dict[str, Any] = {"result": result, "per_prompt": rows}
    if drafting and drafting.diagnosed and not temperature:
        part["answers"] = answers  # what the teacher-forced diagnosis replays (greedy answers)
    return part


def _diagnose(
    loaded: dict[str, Any], prompts: list[EvalPrompt], answers: dict[str, list[int]], steps: int, max_new: int
) -> dict[str, Any]:
    diagnosis = loaded["family"].diagnosis
    pairs = [(p.input_ids, answers[p.id]) for p in prompts if p.id in answers]
    found = diagnosis.load()(loaded["model"], loaded["drafter"], pairs, steps, max_new)
    return {"num_steps": steps, **found}


def _token_counts(store: ArtifactStore, corpus: StageResult, target: TargetInfo) -> Any:
    from aerie.draft.vocab import load_token_counts

    return load_token_counts(store, corpus, target.geometry.vocab_size)


def _vocab_what_if(counts: Any, loaded: dict[str, Any], answers: dict[str, list[int]]) -> dict[str, float]:
    """The answers' coverage by draft vocabs of other sizes, chosen as training chose this one."""
    import torch

    from aerie.draft.vocab import coverage_by_size

    ids = torch.tensor([t for answer in answers.values() for t in answer], dtype=torch.int64)
    size = int(loaded["drafter"].d2t.numel())  # Vd
    return {str(k): round(v, 4) for k, v in coverage_by_size(counts, ids, size).items()}


def _batch_seed(dataset: str, k: int, temperature: float, start: int) -> int:
    return int.from_bytes(
        hashlib.sha256(f"{dataset}/{k}/{temperature:g}/{start}".encode()).digest()[:8], "big"
    )


def _digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def _agreement(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Greedy runs whose output equals the first greedy run's output for the same prompt (all must, if
    lossless; sampled runs differ by design: their losslessness is distributional, tests/test_spec_sampling.py)."""
    first: dict[tuple[str, str], str] = {}
    compared = identical = 0
    for r in rows:
        if r.get("temperature"):
            continue
        key = (r["dataset"], r["id"])
        if key not in first:
            first[key] = r["output_sha"]
            continue
        compared += 1
        identical += first[key] == r["output_sha"]
    return {"compared": compared, "identical": identical}


def _figures(
    results: list[dict[str, Any]], datasets: dict[str, list[EvalPrompt]], agreement: dict[str, int]
) -> dict[str, Any]:
    figures: dict[str, Any] = {f"prompts_{name}": len(p) for name, p in datasets.items()}
    for r in results:
        sampled = f"_t{r['temperature']:g}" if r.get("temperature") else ""
        name = f"accept_{r['dataset']}_{r['proposer']}_k{r['num_steps']}{sampled}"
        figures[name] = r["accept_length"]
        for kind in KINDS:  # a thinking target's: its reasoning and its answers apart
            if kind in r:
                figures[f"{name}_{kind}"] = r[kind]["accept_length"]
    figures["outputs_identical"] = f"{agreement['identical']}/{agreement['compared']}"
    return figures
