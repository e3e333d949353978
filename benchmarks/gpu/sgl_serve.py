"""SGLang serving SmolLM2 without speculation and with an aerie EAGLE-3 drafter (CUDA graphs on).

Each mode is launched through aerie.serving (spec_for + ModelServer: readiness, identity, teardown);
output tokens/s at each concurrency over the held-out ShareGPT prompts, greedy, and per request the
served acceptance length (completion tokens / verify steps, SGLang's meta_info).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from pathlib import Path

SRC = Path(os.environ.get("AERIE_SRC", "/tmp/small/aerie-src"))
sys.path.insert(0, str(SRC))

import httpx  # noqa: E402

from aerie.serving import ServerConfig  # noqa: E402
from aerie.serving.server import ModelServer  # noqa: E402
from aerie.serving.spec import SpeculativeArgs, spec_for  # noqa: E402

FIG: dict = {"modes": {}}


def save(out: Path) -> None:
    (out / "serve.json").write_text(json.dumps(FIG, indent=2, default=str))


async def one(client: httpx.AsyncClient, prompt: str, max_new: int) -> dict:
    body = {"text": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new}}
    r = await client.post("/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


async def run_level(url: str, prompts: list[str], conc: int, n: int, max_new: int) -> dict:
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=conc + 4)) as client:

        async def task(i: int) -> dict:
            async with sem:
                return await one(client, prompts[i % len(prompts)], max_new)

        t = time.perf_counter()
        res = await asyncio.gather(*(task(i) for i in range(n)))
        wall = time.perf_counter() - t
    toks = sum(r["meta_info"]["completion_tokens"] for r in res)
    verify = [r["meta_info"].get("spec_verify_ct") for r in res]
    rec = {
        "concurrency": conc,
        "requests": n,
        "max_new_tokens": max_new,
        "output_tokens": toks,
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(toks / wall, 1),
    }
    if all(v for v in verify):
        rec["accept_length"] = round(toks / sum(verify), 3)
    rec["texts"] = [r["text"] for r in res[: len(prompts)]]
    return rec


def serve_mode(name: str, args, prompts: list[str], out: Path) -> None:
    extra = args.sglang_args.split()
    spec = None
    if name == "eagle3":
        spec = SpeculativeArgs(
            draft_model_path=args.drafter,
            num_steps=args.num_steps,
            eagle_topk=args.topk,
            num_draft_tokens=args.num_draft_tokens,
        )
    port = 31000 + len(FIG["modes"])
    cfg = ServerConfig(
        backend="sglang",
        python=sys.executable,
        port=port,
        startup_timeout_s=args.startup_timeout_s,
        extra_args=extra,
    )
    sspec = spec_for(
        cfg,
        model_path=args.model,
        mode="serve",
        name=f"sglang-{name}",
        speculative=spec,
        log_path=out / f"server-{name}.log",
    )
    rec: dict = {"command": sspec.command}
    FIG["modes"][name] = rec
    t = time.perf_counter()
    try:
        with ModelServer(sspec) as server:
            rec["startup_s"] = round(time.perf_counter() - t, 1)
            print(name, "ready in", rec["startup_s"], "s", flush=True)
            asyncio.run(run_level(server.url, prompts, 4, 8, 32))  # warm-up
            for conc in args.concurrency:
                n = max(args.min_requests, conc * args.requests_per_slot)
                lvl = asyncio.run(run_level(server.url, prompts, conc, n, args.max_new_tokens))
                rec[f"c{conc}"] = lvl
                print(name, f"c{conc}", {k: v for k, v in lvl.items() if k != "texts"}, flush=True)
                save(out)
            try:
                rec["server_info"] = httpx.get(server.url + "/server_info", timeout=10).json()
            except Exception as exc:
                rec["server_info_error"] = repr(exc)
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["traceback"] = traceback.format_exc()[-4000:]
        print(name, "FAILED", traceback.format_exc(), flush=True)
    save(out)


def compare(out: Path) -> None:
    base, spec = FIG["modes"].get("baseline", {}), FIG["modes"].get("eagle3", {})
    cmp: dict = {}
    for key in ("c1", "c8", "c32"):
        if key in base and key in spec:
            b, s = base[key], spec[key]
            cmp[f"speedup_{key}"] = round(s["output_tokens_per_s"] / b["output_tokens_per_s"], 3)
            same = sum(x == y for x, y in zip(b["texts"], s["texts"], strict=False))
            pre = []
            for x, y in zip(b["texts"], s["texts"], strict=False):
                k = 0
                while k < min(len(x), len(y)) and x[k] == y[k]:
                    k += 1
                pre.append(k / max(1, max(len(x), len(y))))
            cmp[f"identical_outputs_{key}"] = f"{same}/{min(len(b['texts']), len(s['texts']))}"
            cmp[f"mean_common_prefix_share_{key}"] = round(sum(pre) / max(1, len(pre)), 3)
            if "accept_length" in s:
                cmp[f"accept_length_{key}"] = s["accept_length"]
    FIG["compare"] = cmp
    save(out)
    print("COMPARE", json.dumps(cmp), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--modes", default="baseline,eagle3")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--requests-per-slot", type=int, default=4)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--startup-timeout-s", type=float, default=300)
    ap.add_argument("--sglang-args", default="")
    args = ap.parse_args()
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(Path(args.prompts).read_text())["prompts"]
    FIG["prompts"] = {
        "count": len(prompts),
        "source": "held-out first user turns of ShareGPT V3, SmolLM2 chat format",
    }
    FIG["drafter"] = args.drafter
    for name in args.modes.split(","):
        serve_mode(name, args, prompts, out)
    compare(out)


if __name__ == "__main__":
    main()
