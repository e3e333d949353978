"""Startup and serving log lines in SGLang's exact format.

aerie's readiness probe turns SGLang's startup lines into progress. The
reference server prints the same lines, in the same format, so that parser is exercised for real:
`[2026-01-01 00:00:00] Load weight begin. avail mem=...`, the tqdm shard bar with SGLang's
`BAR_FORMAT`, `KV Cache is allocated...`, uvicorn's lines, `The server is fired up and ready to roll!`.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import psutil

logger = logging.getLogger("aerie.engine")

# SGLang's scheduler format (utils/common.py) and its tqdm bar format for loading shards.
LOG_FORMAT = "[%(asctime)s] %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
BAR_FORMAT = "{desc}: {percentage:3.0f}% Completed | {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]"
SHARD_BAR_DESC = "Loading safetensors checkpoint shards"
READY_LINE = "The server is fired up and ready to roll!"


def setup_logging(level: str = "info") -> None:
    """Log to stderr, unbuffered enough for a tailing launcher to see each line as it happens."""
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    logger.handlers[:] = [handler]
    logger.setLevel(level.upper())
    logger.propagate = False


def uvicorn_log_config(level: str = "info") -> dict[str, Any]:
    """uvicorn's own lines in the format SGLang configures (`[%(asctime)s] %(levelprefix)s %(message)s`)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "default": {
                "()": "uvicorn.logging.DefaultFormatter",
                "fmt": "[%(asctime)s] %(levelprefix)s %(message)s",
                "datefmt": DATE_FORMAT,
                "use_colors": False,
            },
            "access": {
                "()": "uvicorn.logging.AccessFormatter",
                "fmt": '[%(asctime)s] %(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s',
                "datefmt": DATE_FORMAT,
                "use_colors": False,
            },
        },
        "handlers": {
            "default": {
                "formatter": "default",
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
            },
            "access": {"formatter": "access", "class": "logging.StreamHandler", "stream": "ext://sys.stdout"},
        },
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
            "uvicorn.access": {"handlers": ["access"], "level": level.upper(), "propagate": False},
        },
    }


def avail_mem_gb(device: str) -> float:
    """Free memory where the weights go: the GPU's for CUDA, the host's otherwise."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free / 2**30
    return psutil.virtual_memory().available / 2**30


def shard_bar(total: int) -> Any:
    """The tqdm bar SGLang draws while loading shards (stderr, `\\r` updates)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=SHARD_BAR_DESC, bar_format=BAR_FORMAT, file=sys.stderr, mininterval=0)
