"""The train stage: extract shards + corpus token counts -> an SGLang-loadable drafter.

    <run>/train/<key>/drafter/{config.json, model.safetensors, aerie.json}   the best drafter (by held-out
                                                                   acceptance length in rounds, see below)
    <run>/train/<key>/checkpoints/step-XXXXXXXX/...   the newest `keep_checkpoints`, latest.json points
    <run>/train/<key>/checkpoints/best/...            weights of the best evaluation so far
    <run>/train/<key>/metrics.jsonl, loss.png, accuracy.png
    <run>/train/<key>/manifest.json                   written last

The trainer runs in this process on one device, or as `torchrun` workers (`num_gpus > 1`). Either way
it reports through records (see loop.py); this side turns them into metrics.jsonl, progress and store
uploads. A re-run with the same key resumes from `checkpoints/latest.json` and continues exactly.

Two held-out acceptance figures travel together (aerie/train/objective.py says why both exist):
`accept_length_rounds`, the answers walked in rounds as the decoder walks them (what serving gets; the
best drafter is chosen by it), and `accept_length`, the per-position estimate from cond_acc (runs high).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from aerie.diskspace import writing
from aerie.draft.card import VLLM_CONFIG, CardFacts, drafter_location, write_card
from aerie.draft.vocab import VocabMap, build_vocab_map, load_token_counts
from aerie.errors import ConfigError, DataError, ObjectNotFoundError, TrainingError
from aerie.extract.config import ExtractConfig
from aerie.extract.corpus_rows import open_split
from aerie.extract.plan import check_server_quantization, dump_root
from aerie.families import DEFAULT, family, family_of
from aerie.hostlock import held
from aerie.manifest import StageDir, StageResult, load_manifest, stage_key
from aerie.progress import ProgressFn
from aerie.serving import ServerConfig
from aerie.settings import get_settings
from aerie.shards.keys import shard_keys
from aerie.stage import WorkContext
from aerie.store import ArtifactStore
from aerie.targets import TargetInfo, resolve_device
from aerie.trackers import Trackers, open_trackers, provenance
from aerie.train.checkpoint import FILES
from aerie.train.config import TrainConfig
from aerie.train.data import localize_shards
from aerie.train.distributed import DistInfo
from aerie.train.loop import BEST, TrainSpec, objective_for, run_training
from aerie.train.online import OnlineSpec, SplitSpec
from aerie.train.plots import plot_metrics
from aerie.version import __version__

STAGE = "train"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
LATEST = "checkpoints/latest.json"
BEST_KEY = "checkpoints/best"
# Fields that change where or how loudly the work runs, not its result: kept out of the stage key.
_NOT_KEYED = {"cache_dir", "prefetch_batches", "log_every", "report_to", "tracking_dir"}


def run(
    cfg: TrainConfig,
    ctx: WorkContext,
    *,
    shards: StageResult | None,
    corpus: StageResult,
    extract: ExtractConfig | None = None,
    server: ServerConfig | None = None,
) -> StageResult:
    """Train (or resume, or return the cached result of) the drafter for `ctx.target` into `ctx.stage_dir`
    (keyed by `key_of` over these inputs) on `shards`, or, with `cfg.source` online, on what
    extraction servers (`extract`, `server`) dump for the corpus."""
    online = _online_inputs(cfg, shards, extract, server)
    if (cached := ctx.stage_dir.cached_result()) is not None:
        return cached
    cache = Path(cfg.cache_dir) if cfg.cache_dir else get_settings().cache_dir / "train"
    work = cache / "work" / ctx.stage_dir.run / ctx.stage_dir.key
    with _work_lock(work):
        # Another training of this key may have finished between the look above and the lock.
        if (cached := ctx.stage_dir.cached_result()) is not None:
            return cached
        return _train(cfg, ctx, shards, corpus, online, cache, work)


def _work_lock(work: Path) -> contextlib.AbstractContextManager[None]:
    """Two trainings of one key on this host would write one work folder's checkpoints and metrics and
    upload each other's steps: refuse the second. The lock sits beside the folder, which is removed
    when the training ends."""
    return held(
        work.parent / f".lock-{work.name}",
        TrainingError,
        f"training into {work}",
        f"the training lock beside {work}",
    )


def _train(
    cfg: TrainConfig,
    ctx: WorkContext,
    shards: StageResult | None,
    corpus: StageResult,
    online: tuple[ExtractConfig, ServerConfig] | None,
    cache: Path,
    work: Path,
) -> StageResult:
    stage_dir, target, progress = ctx.stage_dir, ctx.target, ctx.progress
    store, run_name = stage_dir.store, stage_dir.run
    # A family drafting over the target's whole vocabulary (DFlash: its head is the target's) maps none.
    draft_vocab = cfg.drafter.vocab_rows(target.geometry.vocab_size)
    vocab = build_vocab_map(load_token_counts(store, corpus, target.geometry.vocab_size), draft_vocab)

    work.mkdir(parents=True, exist_ok=True)
    train_paths: list[Path] = []
    eval_paths: list[Path] = []
    online_spec: OnlineSpec | None = None
    if online is not None:
        ex, srv = online
        progress(0.0, f"online: corpus splits {', '.join(ex.splits)} through {ex.num_servers} server(s)")
        online_spec = online_spec_for(cfg, ex, srv, store, run_name, stage_dir.key, target, corpus, work)
    else:
        assert shards is not None
        manifest = load_manifest(store, shards.prefix)
        _check_extract(manifest, target, cfg)
        train_keys, eval_keys = shard_keys(manifest, shards.prefix)
        progress(0.0, f"{len(train_keys)} train + {len(eval_keys)} eval shards")
        train_paths = localize_shards(store, train_keys, cache / "shards", _scaled(progress, 0.0, 0.03))
        eval_paths = localize_shards(store, eval_keys, cache / "shards", _scaled(progress, 0.03, 0.05))
    vocab_path = work / "vocab.safetensors"
    with writing(vocab_path, TrainingError):
        save_file({"used": vocab.used, "d2t": vocab.d2t, "t2d": vocab.t2d}, str(vocab_path))

    resume = _restore(store, stage_dir, work)
    device = resolve_device(cfg.device)
    spec = TrainSpec(
        cfg=cfg,
        target=target,
        train_shards=[str(p) for p in train_paths],
        eval_shards=[str(p) for p in eval_paths],
        vocab_path=str(vocab_path),
        work_dir=str(work),
        device=device,
        resume_from=str(work / "checkpoints" / resume) if resume else None,
        online=online_spec,
    )
    events = RecordHandler(store, stage_dir, work, cfg, _scaled(progress, 0.05, 0.95))
    first_step = int(resume.rsplit("-", 1)[-1]) if resume else 0
    with open_trackers(cfg.report_to, cfg.tracking_dir, stage_dir, first_step=first_step) as events.trackers:
        events.trackers.log_params(_tracked_params(cfg, stage_dir, target, shards, corpus))
        if cfg.num_gpus > 1:
            _run_torchrun(spec, cfg.num_gpus, events)
        else:
            run_training(spec, DistInfo(), events)

        progress(0.95, "exporting the best drafter")
        result = _finish(stage_dir, store, cfg, target, vocab, work, events, progress, corpus)
        events.trackers.log_metrics({f"train/{k}": v for k, v in result.figures.items()}, events.step)
    # All a later run can need is in the store now (drafter, metrics, checkpoints); the local copy, with
    # the optimizer states, would otherwise stay behind for every training ever run on this machine.
    shutil.rmtree(work, ignore_errors=True)
    return result


def key_of(
    cfg: TrainConfig,
    target: TargetInfo,
    shards: StageResult | None,
    corpus: StageResult,
    extract: ExtractConfig | None = None,
    server: ServerConfig | None = None,
) -> str:
    """The stage key: the training config but its execution knobs, the upstream manifest digests and
    the target's revision. Computed without touching the shards (the pipeline asks whether training
    is done before it needs them). Online, the shards' digest is replaced by what decides the values
    the servers feed: storage dtype, captured layers, server backend."""
    online = _online_inputs(cfg, shards, extract, server)
    keyed = cfg.model_dump(mode="json", exclude=_NOT_KEYED)
    if online is None:
        keyed.pop("source")  # keyed as before there was a choice
    keyed.pop("online")  # buffer and cache sizes change how, not what
    # Keyed as before these settings existed while they are at their defaults (one row a step, per token).
    if keyed.get("batch_sequences") is None:
        keyed.pop("batch_sequences", None)
    if keyed.get("loss_normalization") == "token":
        keyed.pop("loss_normalization", None)
    upstream = [corpus.manifest_sha256, target.revision]
    if online is not None:
        ex, srv = online
        keyed["features"] = {
            "storage_dtype": ex.storage_dtype,
            "layers": ex.layers_output(target),
            "server_backend": srv.backend,
        }
    else:
        assert shards is not None
        upstream.insert(0, shards.manifest_sha256)
    keyed.update(_family_keyed(keyed.pop("drafter")))
    return stage_key(STAGE, keyed, upstream)


def _family_keyed(settings: dict[str, Any]) -> dict[str, Any]:
    """`train.drafter` keyed as before families were one tagged section and before the default family's
    own settings moved into it: the default family's settings are top-level keys (its keys unchanged);
    another family's name and its settings are two fields, beside the default family's settings at
    their defaults (the shared values such a run was keyed with)."""
    name = settings.pop("family")
    if name == DEFAULT:
        return settings
    defaults = family(DEFAULT).config.model_validate({}).model_dump(mode="json", exclude={"family"})
    return {**defaults, "drafter": name, name: settings}


def _online_inputs(
    cfg: TrainConfig, shards: StageResult | None, extract: ExtractConfig | None, server: ServerConfig | None
) -> tuple[ExtractConfig, ServerConfig] | None:
    """The extraction and server configs of an online training; None for one on shards."""
    if cfg.source == "auto":
        raise ConfigError(
            "train.source auto reached the train stage undecided: the pipeline decides it from the plan "
            "(aerie.pipeline.resolve) before any stage runs"
        )
    if cfg.source == "shards":
        if shards is None:
            raise ConfigError("train.source shards needs the extract stage's result")
        return None
    if extract is None or server is None:
        raise ConfigError("train.source online needs the extract and server configs to run its servers")
    return extract, server


def online_spec_for(
    cfg: TrainConfig,
    extract: ExtractConfig,
    server: ServerConfig,
    store: ArtifactStore,
    run_name: str,
    key: str,
    target: TargetInfo,
    corpus: StageResult,
    work: Path,
) -> OnlineSpec:
    """What the trainer needs to run its own servers: the corpus splits (local copies), where dumps,
    server logs and the optional sample cache go."""
    check_server_quantization(extract, server)
    splits = {s: open_split(store, corpus.prefix, s, work / "corpus") for s in extract.splits}
    if not any(sf.total_rows for sf in splits.values()):
        raise DataError(f"the corpus at {corpus.prefix} has no rows in splits {extract.splits}")
    dumps = dump_root(
        extract, run_name, f"{key}-online", work, target.geometry.hidden_size, target.geometry.vocab_size
    )
    return OnlineSpec(
        extract=extract,
        server=server,
        splits={
            name: SplitSpec(paths=[str(p) for p in sf.paths], rows=sf.rows, tokens=sf.tokens)
            for name, sf in splits.items()
        },
        dump_root=str(dumps),
        log_dir=str(work / "logs"),
        cache_dir=str(work / "online"),
        train_gpus=cfg.num_gpus if server.device != "cpu" else 0,
    )


def _check_extract(extract: dict[str, Any], target: TargetInfo, cfg: TrainConfig) -> None:
    """Shards made for another target (or another layer convention, or another family's layers) would
    train a useless drafter."""
    hidden = extract.get("hidden_size")
    if hidden is not None and int(hidden) != target.geometry.hidden_size:
        raise DataError(
            f"extract shards have hidden size {hidden}, target {target.name} has {target.geometry.hidden_size}"
        )
    layers = extract.get("layers")
    if isinstance(layers, dict):
        out = layers.get("output_of_layer")
        want = cfg.capture_layers(target.geometry.num_layers)
        if out is not None and list(out) != want:
            raise DataError(
                f"extract captured output-of-layer ids {out}, a train.drafter={cfg.drafter.family} drafter reads "
                f"{want} (extract.capture_layers, or leave it unset to take the family's)"
            )


class RecordHandler:
    """Consumes the trainer's records: metrics.jsonl, progress, checkpoint and best uploads."""

    def __init__(
        self, store: ArtifactStore, stage_dir: StageDir, work: Path, cfg: TrainConfig, progress: ProgressFn
    ):
        self.store, self.stage_dir, self.work, self.cfg, self.progress = store, stage_dir, work, cfg, progress
        self.metrics = work / METRICS
        self.total_steps = 1
        self.last_eval: dict[str, Any] | None = None
        self.last_train: dict[str, Any] | None = None
        self.best: dict[str, Any] | None = None
        self.fraction = 0.0
        self.online: list[dict[str, Any]] = []  # each rank's feeder figures (online training)
        self.trackers = Trackers()  # the experiment trackers train.report_to names (aerie.trackers)
        self.step = 0

    def __call__(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind == "start":
            self.total_steps = record["total_steps"]
            self.fraction = record["step"] / self.total_steps
        elif kind == "server":  # an online training's servers: starts, readiness, canary, restarts
            self.progress(self.fraction, record["message"])
        elif kind == "online":
            self.online.append({k: v for k, v in record.items() if k != "kind"})
        elif kind in ("train", "eval"):
            with writing(self.metrics, TrainingError), open(self.metrics, "a") as f:
                f.write(json.dumps(record) + "\n")
            step = self.step = record["step"]
            self.fraction = step / self.total_steps
            self.trackers.log_metrics(tracked_metrics(record), step)
            if kind == "train":
                self.last_train = record
                message = f"step {step}/{self.total_steps} loss {record['loss']:.4f}"
            else:
                self.last_eval = record
                message = (
                    f"step {step}: eval accept length {record['accept_length_rounds']:.3f} in rounds "
                    f"({record['accept_length']:.3f} per position)"
                )
            self.progress(step / self.total_steps, message)
        elif kind == "best":
            self.best = record
            self.store.put_file(
                self.stage_dir.path(f"{BEST_KEY}/model.safetensors"), self.work / BEST / "model.safetensors"
            )
            self.store.put_bytes(self.stage_dir.path(f"{BEST_KEY}/best.json"), json.dumps(record).encode())
        elif kind == "checkpoint":
            self._upload_checkpoint(record["name"], record["step"])
        elif kind == "stopped":
            self.progress(
                record["step"] / self.total_steps,
                f"stopped by signal {record['signal']} at step {record['step']}: checkpoint saved, a re-run resumes",
            )

    def _upload_checkpoint(self, name: str, step: int) -> None:
        local = self.work / "checkpoints" / name
        for file in FILES:
            self.store.put_file(self.stage_dir.path(f"checkpoints/{name}/{file}"), local / file)
        if self.metrics.is_file():
            self.store.put_file(self.stage_dir.path(METRICS), self.metrics)
        self.store.put_bytes(self.stage_dir.path(LATEST), json.dumps({"step": step, "name": name}).encode())
        self._prune(name)

    def _prune(self, newest: str) -> None:
        """Keep the newest `keep_checkpoints` step directories, in the store and on local disk."""
        names = sorted(
            {k.split("/")[-2] for k in self.store.list(self.stage_dir.path("checkpoints")) if "/step-" in k}
        )
        for old in names[: -self.cfg.keep_checkpoints]:
            if old == newest:
                continue
            for file in FILES:
                self.store.delete(self.stage_dir.path(f"checkpoints/{old}/{file}"))
            local = self.work / "checkpoints" / old
            for file in FILES:
                (local / file).unlink(missing_ok=True)
            if local.is_dir():
                local.rmdir()

    def records(self) -> list[dict[str, Any]]:
        if not self.metrics.is_file():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines() if line.strip()]


def tracked_metrics(record: dict[str, Any]) -> dict[str, Any]:
    """What a train or eval record shows in the trackers: loss, learning rate, tokens/s, acceptance."""
    if record["kind"] == "train":
        names = ["loss", "window_loss", "lr", "grad_norm", "tokens_per_s", "tokens"]
        return {f"train/{n}": record[n] for n in names}
    names = ["accept_length_rounds", "accept_length", "acc", "cond_acc", "loss"]
    return {f"eval/{n}": record[n] for n in names if n in record}


def _tracked_params(
    cfg: TrainConfig, stage_dir: StageDir, target: TargetInfo, shards: StageResult | None, corpus: StageResult
) -> dict[str, Any]:
    """The run's config and provenance, as tracker parameters."""
    source = {"corpus": corpus.prefix, "shards": shards.prefix if shards else None}
    upstream = {"target": target.name, "target_revision": target.revision, **source}
    return {"train": cfg.model_dump(mode="json"), "provenance": provenance(stage_dir, **upstream)}


def _restore(store: ArtifactStore, stage_dir: StageDir, work: Path) -> str | None:
    """Bring the latest checkpoint (and metrics/best up to it) from the store into `work`; its name or None."""
    try:
        latest = json.loads(store.get_bytes(stage_dir.path(LATEST)))
    except ObjectNotFoundError:
        (work / METRICS).unlink(missing_ok=True)
        return None
    name, step = latest["name"], int(latest["step"])
    for file in FILES:
        store.get_file(stage_dir.path(f"checkpoints/{name}/{file}"), work / "checkpoints" / name / file)
    # Records past the checkpoint will be produced again by the resumed run.
    kept: list[str] = []
    if store.exists(stage_dir.path(METRICS)):
        lines = store.get_bytes(stage_dir.path(METRICS)).decode().splitlines()
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    (work / METRICS).write_text("".join(line + "\n" for line in kept))
    # A best saved after the checkpoint belongs to the lost future; the resumed run re-finds it.
    best_local = work / BEST / "model.safetensors"
    best_local.unlink(missing_ok=True)
    if store.exists(stage_dir.path(f"{BEST_KEY}/best.json")):
        best = json.loads(store.get_bytes(stage_dir.path(f"{BEST_KEY}/best.json")))
        if int(best["step"]) <= step:
            store.get_file(stage_dir.path(f"{BEST_KEY}/model.safetensors"), best_local)
    return str(name)


def _run_torchrun(spec: TrainSpec, nproc: int, handler: RecordHandler) -> None:
    """torchrun workers (same interpreter as this process: `python -m torch.distributed.run`), their
    records tailed from the events file while they run; a failure raises with the log's last lines."""
    work = Path(spec.work_dir)
    spec_path, events, log = work / "spec.json", work / EVENTS, work / "torchrun.log"
    spec_path.write_text(spec.model_dump_json())
    events.unlink(missing_ok=True)
    events.touch()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "aerie.train.worker", str(spec_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log, "w") as log_f, open(events) as tail:
        proc = subprocess.Popen(cmd, stdout=log_f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        pending = ""
        try:
            while True:
                done = proc.poll() is not None
                pending += tail.read()
                *lines, pending = pending.split("\n")  # a line still being written stays pending
                for line in lines:
                    if line.strip():
                        handler(json.loads(line))
                if done:
                    break
                time.sleep(0.5)
        except BaseException:
            proc.terminate()
            proc.wait(timeout=30)
            raise
    if proc.returncode != 0:
        tail_lines = deque(log.read_text(errors="replace").splitlines(), maxlen=30)
        raise TrainingError(
            f"torchrun ({nproc} workers) exited with {proc.returncode}; checkpoints so far are in the store "
            f"and a re-run resumes. Last log lines ({log}):\n" + "\n".join(tail_lines)
        )


def _finish(
    stage_dir: StageDir,
    store: ArtifactStore,
    cfg: TrainConfig,
    target: TargetInfo,
    vocab: VocabMap,
    work: Path,
    events: RecordHandler,
    progress: ProgressFn,
    corpus: StageResult,
) -> StageResult:
    best_file = work / BEST / "model.safetensors"
    if not best_file.is_file():
        raise TrainingError(f"training ended without a best checkpoint at {best_file}")
    best = json.loads(store.get_bytes(stage_dir.path(f"{BEST_KEY}/best.json")))
    drafter = objective_for(cfg).drafter(target, vocab.draft_vocab_size)
    drafter.load_state_dict(load_file(str(best_file)))
    best_figures = {name: best[name] for name in ("accept_length_rounds", "accept_length")}
    provenance = {"best_step": best["step"], **best_figures, **vocab.figures()}
    out = family_of(cfg.drafter).export.load()(drafter, work / "drafter", target, provenance)
    drafter_files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    for name in drafter_files:
        store.put_file(stage_dir.path(f"drafter/{name}"), out / name)
    records = events.records()
    store.put_file(stage_dir.path(METRICS), events.metrics)
    plots = plot_metrics(records, work / "plots")
    for png in plots:
        store.put_file(stage_dir.path(png.name), png)
    progress(1.0, f"best step {best['step']}: accept length {best['accept_length_rounds']:.3f} in rounds")

    layers = cfg.capture_layers(target.geometry.num_layers)
    last_train = events.last_train or next((r for r in reversed(records) if r["kind"] == "train"), {})
    last_eval = events.last_eval or next((r for r in reversed(records) if r["kind"] == "eval"), {})
    manifest = _with_card(
        stage_dir,
        corpus,
        out,
        {
            "target": {"name": target.name, "revision": target.revision},
            "corpus": corpus.prefix,
            "layers": {
                "output_convention": layers,
                "input_convention": [i + 1 for i in layers],
            },
            "vocab": {**vocab.figures(), "used_sha256": _digest(vocab.used)},
            "training": {
                "config": cfg.model_dump(mode="json"),
                "total_steps": last_train.get("total_steps"),
                "tokens": last_train.get("tokens"),
                # Over every run that trained this drafter (the manifest's `seconds` is the last run's).
                "wall_s": last_train.get("elapsed_s"),
                "runs": last_train.get("runs"),
            },
            "best": {"step": best["step"], **best_figures},
            "final": {
                "step": last_train.get("step"),
                "loss": last_train.get("loss"),
                "step_loss": last_train.get("step_loss"),
                "eval": last_eval,
            },
            "family": cfg.drafter.family,
            **({"online": _online_record(events.online)} if cfg.source == "online" else {}),
            "drafter_config": json.loads((out / "config.json").read_text()),
            "files": {
                "drafter": [f"drafter/{n}" for n in drafter_files],
                "metrics": METRICS,
                "plots": [p.name for p in plots],
                "checkpoints": "checkpoints/",
            },
            "figures": {
                "best_step": best["step"],
                "accept_length_rounds": best["accept_length_rounds"],
                "accept_length": best["accept_length"],
                "final_loss": last_train.get("loss"),
                "eval_acc_step0": (last_eval.get("acc") or [None])[0],
                "vocab_coverage": round(vocab.coverage, 4),
                "draft_vocab_size": vocab.draft_vocab_size,
                "train_tokens": last_train.get("tokens"),
                "steps": last_train.get("step"),
                "train_wall_s": last_train.get("elapsed_s"),
                **(_online_figures(events.online) if cfg.source == "online" else {}),
            },
        },
    )
    return stage_dir.finish(manifest)


def _with_card(
    stage_dir: StageDir, corpus: StageResult, out: Path, manifest: dict[str, Any]
) -> dict[str, Any]:
    """The drafter's card (aerie.draft.card) from what training knows, into the drafter directory;
    the manifest with it among the drafter's files."""
    store = stage_dir.store
    facts = CardFacts(
        train={**manifest, "run": stage_dir.run, "key": stage_dir.key, "aerie_version": __version__},
        drafter_dir=drafter_location(store, stage_dir.path("drafter")),
        corpus=load_manifest(store, corpus.prefix),
        vllm=(out / VLLM_CONFIG).is_file(),
    )
    key = write_card(store, stage_dir.path("drafter"), facts)
    files = manifest["files"]["drafter"]
    return {
        **manifest,
        "files": {**manifest["files"], "drafter": sorted({*files, key.removeprefix(stage_dir.prefix + "/")})},
    }


def _online_record(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The feeders' figures of the run that finished the training (a resumed one: its own part)."""
    return {"ranks": ranks, "shard_bytes_written": 0}


def _online_figures(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    servers = [s for r in ranks for s in r.get("servers", [])]
    return {
        "source": "online",
        "extracted_tokens": sum(r.get("extracted_tokens", 0) for r in ranks),
        "server_restarts": sum(s["restarts"] for s in servers),
        "servers": len(servers),
    }


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.to(torch.int64).numpy().tobytes()).hexdigest()


def _scaled(progress: ProgressFn, lo: float, hi: float) -> ProgressFn:
    def report(fraction: float, message: str) -> None:
        progress(lo + (hi - lo) * max(0.0, min(1.0, fraction)), message)

    return report
