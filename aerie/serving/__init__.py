"""Model servers that cannot fool the pipeline: launch, readiness, identity, teardown.

    spec = spec_for(cfg.server, model_path=target.path, mode="extract", dump_dir=work / "dumps")
    with ModelServer(spec, progress=progress, canary=canary) as server:
        ...  # server.url, server.info

See `aerie.serving.server` for how each fault of a bash wait loop is handled.
"""

from aerie.serving.config import ServerConfig
from aerie.serving.container import DockerLauncher, run_kwargs
from aerie.serving.launcher import Launcher, ProcessLauncher, StopResult, check_interpreter
from aerie.serving.probe import describe_listener, ensure_port_free, port_is_free
from aerie.serving.server import Canary, ModelServer, TeardownReport
from aerie.serving.spec import (
    ServerSpec,
    SpeculativeArgs,
    model_size_on_disk,
    new_nonce,
    spec_for,
    startup_deadline,
)
from aerie.serving.startup_log import LogTail, StartupLog
from aerie.serving.teardown import clean_dump_dir, sweep_shm, wait_port_free

__all__ = [
    "Canary",
    "DockerLauncher",
    "Launcher",
    "LogTail",
    "ModelServer",
    "ProcessLauncher",
    "ServerConfig",
    "ServerSpec",
    "SpeculativeArgs",
    "StartupLog",
    "StopResult",
    "TeardownReport",
    "check_interpreter",
    "clean_dump_dir",
    "describe_listener",
    "ensure_port_free",
    "model_size_on_disk",
    "new_nonce",
    "port_is_free",
    "run_kwargs",
    "spec_for",
    "startup_deadline",
    "sweep_shm",
    "wait_port_free",
]
