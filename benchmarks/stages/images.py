"""Build times of aerie's images: cold, warm (unchanged) and after a code change.

    python benchmarks/stages/images.py [--images base worker-cpu sglang-cpu] [--out benchmarks/results/images-cpu.json]

Cold: no root filesystem, no wheelhouse, no pip cache and no image of the build: `docker/build-images.sh`
runs from a fresh clone of HEAD with its own cache dir (AERIE_CACHE), its own image namespace
(AERIE_IMAGE_NS=aerie-bench, so aerie's own images and their layer cache are not touched) and
PIP_NO_CACHE_DIR=1; a cold build therefore makes the debootstrap root filesystem and downloads every wheel
from pip's configured index. Warm: the same command again, nothing changed (a no-op by the images'
aerie.input-digest labels). Code change: one comment line appended to aerie/__init__.py of the clone,
then the worker image again (its dependency layer comes from the layer cache). Every image and cache the
benchmark made is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NS = "aerie-bench"


def build(clone: Path, cache: Path, images: str) -> tuple[float, str]:
    env = {
        **os.environ,
        "AERIE_CACHE": str(cache),
        "AERIE_IMAGE_NS": NS,
        "IMAGES": images,
        "PIP_NO_CACHE_DIR": "1",
        "PYTHON": sys.executable,
    }
    began = time.monotonic()
    out = subprocess.run(
        ["bash", str(clone / "docker" / "build-images.sh")], env=env, capture_output=True, text=True
    )
    seconds = time.monotonic() - began
    if out.returncode != 0:
        raise SystemExit(f"images: build of {images} failed:\n{out.stdout}\n{out.stderr}")
    # The script's own lines (what it built, in how long), not pip's warnings about the index.
    said = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("images:")]
    return seconds, "\n".join(said)


def image_size(tag: str) -> int:
    out = subprocess.run(
        ["docker", "image", "inspect", tag, "--format", "{{.Size}}"], capture_output=True, text=True
    )
    return int(out.stdout.strip()) if out.returncode == 0 else 0


def remove_bench_images() -> None:
    tags = subprocess.run(
        ["docker", "images", "--format", "{{.Repository}}:{{.Tag}}", f"{NS}/*"],
        capture_output=True,
        text=True,
    ).stdout.split()
    if tags:
        subprocess.run(["docker", "rmi", "-f", *tags], capture_output=True)
    for name in ("base", "worker-cpu", "sglang-cpu"):
        subprocess.run(
            ["docker", "image", "prune", "-f", "--filter", f"label=aerie.image={name}"], capture_output=True
        )


def tag_of(image: str, clone: Path) -> str:
    if image == "base":
        return f"{NS}/base:bookworm"
    if image == "sglang-cpu":
        return f"{NS}/sglang-cpu:{(clone / 'envs' / 'sglang' / 'VERSION').read_text().strip()}"
    return f"{NS}/{image}:latest"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", nargs="+", default=["base", "worker-cpu", "sglang-cpu"])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "images-cpu.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="aerie-images-bench-"))
    clone, cache = work / "repo", work / "cache"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(clone)], check=True)
    figures: dict[str, dict[str, object]] = {}
    try:
        remove_bench_images()
        for image in args.images:
            # base first: every other image builds on it, so its cold time is counted once, in base.
            cold, log = build(clone, cache, image)
            warm, warm_log = build(clone, cache, image)
            figures[image] = {
                "cold_s": round(cold, 1),
                "warm_s": round(warm, 1),
                "size_bytes": image_size(tag_of(image, clone)),
                "cold_log": log.splitlines()[-3:],
                "warm_log": warm_log.splitlines()[-1:],
            }
            print(image, figures[image], flush=True)
        if "worker-cpu" in args.images:
            with open(clone / "aerie" / "__init__.py", "a") as out:
                out.write("# a code change\n")
            changed, log = build(clone, cache, "worker-cpu")
            figures["worker-cpu"]["code_change_s"] = round(changed, 1)
            figures["worker-cpu"]["code_change_log"] = log.splitlines()[-1:]
        wheelhouse = cache / "wheelhouse"
        figures["wheelhouse_bytes"] = {"bytes": sum(f.stat().st_size for f in wheelhouse.glob("*.whl"))}
    finally:
        remove_bench_images()
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"docker {subprocess.run(['docker', 'version', '--format', '{{.Server.Version}}'], capture_output=True, text=True).stdout.strip()}",
        "command": "python benchmarks/stages/images.py " + " ".join(sys.argv[1:]),
        "figures": figures,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
