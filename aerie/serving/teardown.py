"""What a killed server leaves behind, and how to clear it: its port, `/dev/shm` segments, dump files.

SGLang is torn down with SIGKILL (`kill_process_tree`, PDEATHSIG), which skips every Python-level
unlink, so `/dev/shm` fills until the next scheduler dies with SIGBUS. SGLang
sweeps only in its CI; otherwise it is cleared by hand. Segments named after their creator's pid are
safe to remove once that pid is dead; those are the only ones swept here.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

from aerie.serving.probe import port_holders, port_is_free

log = logging.getLogger(__name__)

# Set in a launched server's environment (its value: the launch's nonce). Every process the server
# starts inherits it, also one that leaves the process group and session (setsid) or is reparented:
# the one mark that finds the whole tree after its root has exited.
SERVER_TOKEN_ENV = "AERIE_SERVER_TOKEN"
# Beside it: `<pid>:<start time>` of the process that launched the server. A server whose launcher is
# gone (killed with SIGKILL, no teardown ran) is an orphan that the next launch may end.
SERVER_OWNER_ENV = "AERIE_SERVER_OWNER"
SGL_SHM_PREFIX = "sgl_shm_"
MULTI_TOKENIZER_PREFIX = "multi_tokenizer_args_"


def creator_pid(name: str) -> int | None:
    """The pid embedded in an SGLang segment name, or None for names that carry none.

    `sgl_shm_<kind>_<pid>_<rand>` (`make_shm_name`; kind may contain `_`) and `multi_tokenizer_args_<pid>`.
    """
    text: str | None = None
    if name.startswith(SGL_SHM_PREFIX):
        parts = name.split("_")
        if len(parts) >= 5:  # sgl, shm, kind..., pid, rand
            text = parts[-2]
    elif name.startswith(MULTI_TOKENIZER_PREFIX):
        text = name[len(MULTI_TOKENIZER_PREFIX) :]
    if text is None or not text.isdigit():
        return None
    pid = int(text)
    return pid if pid > 0 else None  # 0 and negatives address process groups, not a process


def pid_alive(pid: int) -> bool:
    """Whether `pid` exists (another user's process, which we may not signal, counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_shm(
    directory: str | os.PathLike[str] = "/dev/shm",
    *,
    only: Iterable[str] | None = None,
    is_alive: Callable[[int], bool] = pid_alive,
) -> list[Path]:
    """Unlink SGLang segments in `directory` whose creator pid is dead; return what was removed.

    `only` restricts the sweep to those names (the container case: names that appeared during our
    container's life, since pids inside a container mean nothing on the host). Segments of live
    pids, and names without a pid, are never touched.
    """
    root = Path(directory)
    allowed = set(only) if only is not None else None
    removed: list[Path] = []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return removed
    for name in names:
        if allowed is not None and name not in allowed:
            continue
        pid = creator_pid(name)
        if pid is None or is_alive(pid):
            continue
        path = root / name
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot remove leftover %s: %s", path, exc)
            continue
        removed.append(path)
    if removed:
        log.info("swept %d leftover segment(s) from %s", len(removed), root)
    return removed


def list_segments(directory: str | os.PathLike[str]) -> set[str]:
    """Names of pid-carrying SGLang segments now in `directory` (a snapshot before a launch)."""
    try:
        return {n for n in os.listdir(directory) if creator_pid(n) is not None}
    except FileNotFoundError:
        return set()


def wait_port_free(host: str, port: int, timeout: float = 30.0, interval: float = 0.1) -> bool:
    """Wait until `host:port` can be bound again and nothing answers there; False at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if port_is_free(host, port):
                return True
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                raise
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def clean_dump_dir(path: str | os.PathLike[str]) -> int:
    """Remove what a server dumped under `path` (the dir itself stays); return the files removed."""
    root = Path(path)
    if not root.is_dir():
        return 0
    count = 0
    for child in root.iterdir():
        if child.is_dir() and not child.is_symlink():
            count += sum(1 for p in child.rglob("*") if p.is_file())
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
            count += 1
    return count


def tagged_processes(token: str) -> list[int]:
    """Live (non-zombie) pids whose environment carries `SERVER_TOKEN_ENV=token`: what one launch
    started, wherever it moved in the process tree."""
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(SERVER_TOKEN_ENV) == token:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return sorted(found)


def describe_pid(pid: int) -> str:
    """`pid 123 (python -c import os...)` for messages; the command line is cut, never the env."""
    try:
        cmdline = " ".join(psutil.Process(pid).cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return f"pid {pid}"
    cmdline = cmdline if len(cmdline) <= 80 else cmdline[:77] + "..."
    return f"pid {pid} ({cmdline})" if cmdline else f"pid {pid}"


def end_processes(pids: Iterable[int], grace_s: float = 1.0) -> list[int]:
    """SIGTERM, `grace_s`, then SIGKILL; returns the pids still alive after that (none, normally)."""
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.send_signal(signal.SIGTERM)
            procs.append(proc)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        except psutil.AccessDenied:
            log.warning("cannot signal %s: not ours to end", describe_pid(pid))
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        except psutil.AccessDenied:
            log.warning("cannot kill %s", describe_pid(proc.pid))
    _, alive = psutil.wait_procs(alive, timeout=5.0)
    return sorted(p.pid for p in alive if _running(p))


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def owner_mark() -> str:
    """This process as `SERVER_OWNER_ENV` names it: pid and start time (a pid alone can be reused)."""
    return f"{os.getpid()}:{psutil.Process().create_time():.3f}"


def orphaned_servers(port: int) -> dict[str, list[int]]:
    """Servers aerie launched that hold `port` although their launcher is gone: token -> every live
    process of that launch. A server whose launcher lives (another pipeline) is never in it."""
    found: dict[str, list[int]] = {}
    for pid in port_holders(port):
        try:
            env = psutil.Process(pid).environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        token, owner = env.get(SERVER_TOKEN_ENV), env.get(SERVER_OWNER_ENV)
        if token and owner and not _owner_alive(owner):
            found[token] = tagged_processes(token)
    return found


def _owner_alive(mark: str) -> bool:
    pid_text, _, started = mark.partition(":")
    try:
        proc = psutil.Process(int(pid_text))
        return proc.status() != psutil.STATUS_ZOMBIE and f"{proc.create_time():.3f}" == started
    except (ValueError, psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True
