"""A real moto S3 server for tests: a separate process on 127.0.0.1, spoken to over HTTP by boto3.

Use it from any test module (a plugin line, not an import: ruff flags imported fixtures as F811):

    pytest_plugins = ("tests.s3_support",)

    def test_something(s3_config: StoreConfig) -> None:
        store = open_store(s3_config)  # an S3Store on its own fresh prefix of the session bucket

`s3_server` (session) starts the server once, creates the bucket and sets dummy AWS credentials in the
environment (so child processes, e.g. Prefect flow runs, reach it too); it yields the `StoreConfig`
of `s3://aerie-test/session`. `s3_config` (function) gives each test its own prefix.
`raw_client(cfg)` is a plain boto3 client for tests that must reach behind the store.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from aerie.store import StoreConfig
from tests.conftest import free_port

BUCKET = "aerie-test"
REGION = "us-east-1"
# Dummies: moto accepts any credentials. Set for the whole session so nothing reaches for ~/.aws.
DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "aerie-test-access-key",
    "AWS_SECRET_ACCESS_KEY": "aerie-test-secret-key-must-never-be-printed",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
}
_UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
STARTUP_TIMEOUT_S = 60.0  # moto imports a lot; the CI machine is shared


def raw_client(cfg: StoreConfig) -> Any:
    """A boto3 S3 client for the server behind `cfg`, bypassing the store (to corrupt, inspect...)."""
    return boto3.client("s3", endpoint_url=cfg.s3_endpoint_url, region_name=cfg.s3_region or REGION)


def _wait_until_up(proc: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited with {proc.returncode}:\n{log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise RuntimeError(
        f"moto server not up at {url} after {STARTUP_TIMEOUT_S:.0f} s:\n{log_path.read_text()[-2000:]}"
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[StoreConfig]:
    """A moto S3 server process with bucket `aerie-test`; yields the StoreConfig of its root."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_dir = Path(tempfile.mkdtemp(prefix="aerie-moto-"))
    log_path = log_dir / "moto.log"
    with pytest.MonkeyPatch.context() as mp:
        for name, value in DUMMY_ENV.items():
            mp.setenv(name, value)
        for name in _UNSET:
            mp.delenv(name, raising=False)
        # Keep a developer's ~/.aws/config (s3 settings, profiles) out of the tests.
        mp.setenv("AWS_CONFIG_FILE", str(log_dir / "no-aws-config"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(log_dir / "no-aws-credentials"))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=os.environ.copy(),
            )
        try:
            _wait_until_up(proc, url, log_path)
            cfg = StoreConfig(
                uri=f"s3://{BUCKET}/session",
                s3_endpoint_url=url,
                s3_region=REGION,
                multipart_chunk_mb=5,  # S3's minimum part size: a 12 MB file is a 3-part upload
                max_concurrency=4,
                s3_max_attempts=3,
                s3_connect_timeout_s=5,
                s3_read_timeout_s=30,
            )
            raw_client(cfg).create_bucket(Bucket=BUCKET)
            yield cfg
        finally:
            _stop(proc)


@pytest.fixture
def s3_config(s3_server: StoreConfig) -> StoreConfig:
    """The session server's config with a fresh prefix, so tests never see each other's objects."""
    return s3_server.model_copy(update={"uri": f"s3://{BUCKET}/t-{uuid.uuid4().hex[:12]}"})
