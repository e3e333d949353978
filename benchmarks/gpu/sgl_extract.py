"""SGLang extraction through aerie's dump plugin, beside the roofline of benchmarks/stages/extract.py.

Runs the real extract stage (aerie.extract.work.run) with server.backend=sglang over a ShareGPT corpus
(token ids in corpus.npz), and optionally the reference server over the same corpus; then, optionally,
trains a drafter on the SGLang shards with aerie's train stage. Writes figures to --out as it goes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

SRC = Path(os.environ.get("AERIE_SRC", "/tmp/small/aerie-src"))
sys.path.insert(0, str(SRC / "benchmarks" / "stages"))
sys.path.insert(0, str(SRC))

import extract as bx  # noqa: E402  (benchmarks/stages/extract.py)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from aerie.extract.config import ExtractConfig  # noqa: E402
from aerie.manifest import StageDir  # noqa: E402
from aerie.serving import ServerConfig  # noqa: E402
from aerie.store import LocalStore  # noqa: E402
from aerie.targets import resolve_target  # noqa: E402

FIG: dict = {"notes": []}


def save(out: Path) -> None:
    (out / "extract.json").write_text(json.dumps(FIG, indent=2, default=str))


def load_corpus(path: Path, limit_tokens: int | None) -> list[list[int]]:
    z = np.load(path)
    ids, lens = z["ids"].astype(np.int64), z["lens"]
    out, at = [], 0
    for n in lens:
        out.append(ids[at : at + n].tolist())
        at += int(n)
        if limit_tokens and at >= limit_tokens:
            break
    return out


def run_pipeline(backend: str, target, store, corpus, work: Path, args, storage: str, server_quantize: bool):
    cfg = ExtractConfig(
        storage_dtype=storage,
        shard_bytes=args.shard_mb << 20,
        batch_tokens=args.batch_tokens,
        requests_in_flight=args.requests_in_flight,
        splits=["train"],
        work_dir=str(work / f"pipe-{backend}"),
        delete_local_after_upload=True,
        quantize_on_server=server_quantize,
    )
    if backend == "sglang":
        server = ServerConfig(
            backend="sglang",
            python=sys.executable,
            port=bx._free_port(),
            startup_timeout_s=args.startup_timeout_s,
            extra_args=args.sglang_args.split(),
        )
    else:
        server = ServerConfig(
            backend="reference",
            device="cuda",
            port=bx._free_port(),
            extra_args=["--max-batch-tokens", str(args.batch_tokens), "--dump-writers", "2"],
        )
    began = time.perf_counter()
    result = bx.run_extract(
        cfg, store=store, run_name=f"bench-{backend}", target=target, corpus=corpus, server=server
    )
    wall = time.perf_counter() - began
    f = result.figures
    rec = {
        "backend": backend,
        "storage_dtype": storage,
        "quantized_on": None if storage != "fp8" else ("server" if server_quantize else "client"),
        "tokens": f["tokens"],
        "shards": f["shards"],
        "bytes": f["bytes"],
        "bytes_per_token": round(f["bytes"] / f["tokens"], 2),
        "steady_tokens_per_s": f["steady_tokens_per_s"],
        "wall_s_incl_startup_and_canary": round(wall, 1),
        "wall_tokens_per_s_incl_startup": round(f["tokens"] / wall, 1),
        "canary_passed": f.get("canary_passed"),
        "server_args": server.extra_args,
        "phases": f.get("phases"),
        "figures_keys": sorted(f),
    }
    return result, rec


sglang_result = None


def extract_step(backend: str, target, store, corpus, work: Path, out: Path, args):
    """One backend's extraction into FIG["pipeline"] (fp8 quantized on the reference server, on SGLang's
    client); a failure is recorded there, and None returned."""
    result = None
    try:
        quant = backend == "reference" and args.storage == "fp8"
        result, rec = run_pipeline(backend, target, store, corpus, work, args, args.storage, quant)
        FIG["pipeline"][backend] = rec
        print(f"pipeline {backend}:", json.dumps(rec, default=str)[:3000], flush=True)
    except Exception as exc:
        FIG["pipeline"][backend] = {
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-4000:],
        }
        print(f"pipeline {backend} FAILED:", traceback.format_exc(), flush=True)
    save(out)
    return result


def train_drafter(target, store, corpus, shards, work: Path, out: Path, args) -> None:
    """aerie's train stage on the SGLang shards (the preset smollm2-gpu's training settings, fewer epochs)."""
    from aerie.stage import WorkContext
    from aerie.train.config import DraftShapeConfig, TrainConfig
    from aerie.train.work import key_of, run

    t = time.perf_counter()
    try:
        tcfg = TrainConfig(
            device=args.train_device,
            drafter={"family": "eagle3", "draft_vocab_size": 32768, "init_head_from_target": True},
            draft=DraftShapeConfig(intermediate_size=4608),
            lr=1e-3,
            batch_tokens=32768,
            max_length=2048,
            eval_every=100,
            checkpoint_every=200,
            epochs=args.train_epochs,
            cache_dir=str(work / "traincache"),
        )
        into = StageDir(store, "bench-sglang", "train", key_of(tcfg, target, shards, corpus))
        res = run(tcfg, WorkContext(stage_dir=into, target=target), shards=shards, corpus=corpus)
        found = sorted(Path(store.root).rglob("train/*/drafter/config.json"))
        drafter = found[-1].parent if found else None
        if drafter is not None:
            dest = Path(args.drafter_out)
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(drafter, dest)
            for name in ("config.json", "aerie.json"):
                if (dest / name).exists():
                    shutil.copy(dest / name, out / f"drafter-{name}")
        FIG["train"] = {
            "epochs": args.train_epochs,
            "seconds": round(time.perf_counter() - t, 1),
            "figures": res.figures,
            "drafter": str(drafter),
            "copied_to": args.drafter_out,
        }
        print("train:", json.dumps(FIG["train"], default=str)[:3000], flush=True)
    except Exception as exc:
        FIG["train"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        print("train FAILED:", traceback.format_exc(), flush=True)
    save(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--limit-tokens", type=int, default=None)
    ap.add_argument("--work", default="/tmp/xwork")
    ap.add_argument("--steps", default="roofline,sglang,reference")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch-tokens", type=int, default=65536)
    ap.add_argument("--requests-in-flight", type=int, default=4)
    ap.add_argument("--shard-mb", type=int, default=1024)
    ap.add_argument("--storage", default="fp8")
    ap.add_argument("--startup-timeout-s", type=float, default=300)
    ap.add_argument("--sglang-args", default="")
    ap.add_argument("--train-epochs", type=float, default=2.0)
    ap.add_argument("--train-device", default="cuda")
    ap.add_argument("--drafter-out", default="/tmp/drafter-trained")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    steps = args.steps.split(",")
    t0 = time.perf_counter()
    target = resolve_target("smollm2-135m-instruct")
    FIG["target_path"] = str(target.path) if hasattr(target, "path") else None
    FIG["torch"] = torch.__version__
    FIG["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:
        import sglang

        FIG["sglang"] = sglang.__version__
    except Exception as exc:  # recorded, not fatal for the roofline
        FIG["sglang_import_error"] = repr(exc)
    sequences = load_corpus(Path(args.corpus), args.limit_tokens)
    FIG["corpus"] = {
        "source": "ShareGPT V3 conversations, SmolLM2 chat format",
        "samples": len(sequences),
        "tokens": sum(map(len, sequences)),
    }
    print("corpus", FIG["corpus"], "target ready in", round(time.perf_counter() - t0, 1), "s", flush=True)
    save(out)
    store = LocalStore(work / "store")
    corpus = bx.write_corpus(store, sequences, work, source="sharegpt", token_counts=True)
    if "roofline" in steps:
        t = time.perf_counter()
        FIG["bare_forward"] = bx.bare_forward(target, args.device, sequences, [16384, 65536])
        print("bare forward:", FIG["bare_forward"], round(time.perf_counter() - t, 1), "s", flush=True)
        save(out)
        t = time.perf_counter()
        cw = ExtractConfig().resolved_commit_workers()
        FIG["storage_write"] = bx.storage_write(work, args.shard_mb, target, cw, 0.0)
        print("storage write:", FIG["storage_write"], round(time.perf_counter() - t, 1), "s", flush=True)
        save(out)
    FIG["pipeline"] = {}
    for backend in ("sglang", "reference"):
        result = extract_step(backend, target, store, corpus, work, out, args) if backend in steps else None
        if backend == "sglang" and result is not None:
            global sglang_result
            sglang_result = result
            FIG["sglang_extract_prefix"] = result.prefix
            (out / "sglang_extract_result.json").write_text(json.dumps({"prefix": result.prefix}))
    if "train" in steps and FIG.get("sglang_extract_prefix"):
        train_drafter(target, store, corpus, sglang_result, work, out, args)
    if "reference_after" in steps:
        extract_step("reference", target, store, corpus, work, out, args)
        shutil.rmtree(Path(store.root) / "bench-reference", ignore_errors=True)
    bare = FIG.get("bare_forward", {}).get("best_tokens_per_s")
    wbps = FIG.get("storage_write", {}).get("write_bytes_per_s")
    for p in FIG["pipeline"].values():
        if bare and wbps and "steady_tokens_per_s" in p:
            roof = min(bare, wbps / p["bytes_per_token"])
            p["roofline_tokens_per_s"] = round(roof, 1)
            p["roofline_bound"] = "forward" if bare <= wbps / p["bytes_per_token"] else "storage"
            p["efficiency"] = round(p["steady_tokens_per_s"] / roof, 3)
    FIG["total_s"] = round(time.perf_counter() - t0, 1)
    save(out)
    print(
        "DONE",
        json.dumps(
            {
                k: (v.get("steady_tokens_per_s"), v.get("efficiency")) if isinstance(v, dict) else v
                for k, v in FIG["pipeline"].items()
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
