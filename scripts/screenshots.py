"""Re-take the README screenshots of a real pipeline run in the Prefect UI.

Why a script: the screenshots go stale whenever the flows or their artifacts change, so they are
taken from a real run rather than edited by hand. The script starts its own Prefect server (UI on),
runs `aerie_pipeline` on the embedded smollm2-local preset shrunk to minutes on a CPU, then points
headless Chromium at the flow-run page, the artifacts page and one artifact's page. Every process it
starts is stopped by pid on the way out, and all state lives in a temporary directory.

Usage: .venv/bin/python scripts/screenshots.py --out docs/screenshots
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the shared tiny configuration lives in tests/pipeline_support.py
from tests import pipeline_support  # noqa: E402
from tests.processes import free_port, prefect_server, stop  # noqa: E402

RUN_NAME = "screenshots"


def tiny_overrides(store: Path) -> list[str]:
    """The test suite's tiny pipeline: every stage runs for real, in minutes."""
    return pipeline_support.tiny_overrides(store, run=RUN_NAME, port=free_port())


def run_pipeline(base: str, home: Path, store: Path) -> None:
    """Run the real pipeline flow in a child process reporting to our server."""
    code = (
        "import sys\n"
        "from flows.pipeline import aerie_pipeline\n"
        "aerie_pipeline(preset='smollm2-local', overrides=sys.argv[1:])\n"
    )
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"{base}/api"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *tiny_overrides(store)], cwd=ROOT, env=env, start_new_session=True
    )
    try:
        if proc.wait() != 0:
            raise RuntimeError(f"pipeline run failed with exit code {proc.returncode}")
    finally:
        stop(proc)


async def find_pages(base: str) -> dict[str, str]:
    """The UI URLs to shoot: the top-level flow run, the artifacts list, one artifact's page."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentTaskRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # Without an explicit API URL the client would quietly start an ephemeral server of its own.
    with temporary_settings({PREFECT_API_URL: f"{base}/api"}):
        async with get_client() as client:
            # The pipeline's run is the one not started from a task of another run.
            top = FlowRunFilter(parent_task_run_id=FlowRunFilterParentTaskRunId(is_null_=True))
            runs = await client.read_flow_runs(flow_run_filter=top)
            if not runs:
                raise RuntimeError("no top-level flow run found on the server")
            run_id = runs[0].id
            artifacts = {a.key: a.id for a in await client.read_artifacts() if a.key}
    # The evaluation report is the page a reader most wants; the summary is there if it is not.
    wanted = [k for k in artifacts if k.startswith("evaluate") and k.endswith("report")]
    wanted += [k for k in artifacts if k.endswith("summary")]
    if not wanted:
        raise RuntimeError(f"no report artifact among {sorted(artifacts)}")
    return {
        "flow-run": f"{base}/runs/flow-run/{run_id}",
        # The run page's Artifacts tab cannot be opened from its URL (`?tab=Artifacts` falls back to
        # Logs), and it lists only the top-level run's own artifacts; the server is fresh, so the
        # artifacts page holds exactly this run's, every stage's included.
        "artifacts": f"{base}/artifacts",
        "artifact": f"{base}/artifacts/artifact/{artifacts[wanted[0]]}",
    }


def shoot(url: str, png: Path, budget_ms: int) -> None:
    """One headless Chromium screenshot; the virtual-time budget lets the client-side app render."""
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        args = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            "--window-size=1600,1000",
            f"--screenshot={png}",
            f"--virtual-time-budget={budget_ms}",
            url,
        ]
        proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            proc.wait(timeout=120)
        finally:
            stop(proc)
    if not png.exists():
        raise RuntimeError(f"chromium wrote no screenshot for {url}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    parser.add_argument("--budget-ms", type=int, default=20000, help="Chromium virtual-time budget per page")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="aerie-screens-") as tmp:
        home, store = Path(tmp) / "prefect", Path(tmp) / "store"
        home.mkdir()
        with prefect_server(home, ui=True) as (base, _env):
            run_pipeline(base, home, store)
            pages = asyncio.run(find_pages(base))
            for name, url in pages.items():
                png = args.out / f"{name}.png"
                shoot(url, png, args.budget_ms)
                print(f"{png}  <- {url}")


if __name__ == "__main__":
    main()
