"""The benchmark's child processes, each in a process group of its own.

A configuration is one process, but vLLM starts its engine core as a child of it, and that child
holds the GPU's memory. subprocess.run's timeout kills only the direct child, and a bench stopped
by a signal killed none: the engine core lived on, and the next run on that GPU failed to start
(seen on the H200: "Free memory on device cuda:0 (8.89/139.8 GiB) on startup is less than desired").
Here a timeout kills the whole group, and `stop_all` (the bench's SIGTERM/SIGINT handler) kills
every group still running.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading

_LIVE: set[int] = set()  # process group ids of the children running now
_LOCK = threading.Lock()


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def run_group(cmd: list[str], *, timeout: float | None = None, **popen) -> subprocess.CompletedProcess:
    """subprocess.run(cmd) in a new process group; on a timeout the whole group is killed (then
    TimeoutExpired is raised, as subprocess.run does)."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    with _LOCK:
        _LIVE.add(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _kill_group(proc.pid)
        proc.communicate()
        raise
    finally:
        with _LOCK:
            _LIVE.discard(proc.pid)
        _kill_group(proc.pid)  # what the run left behind (an engine core that outlived its parent)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop_all(signum: int = signal.SIGTERM, *_frame) -> None:
    """Kill every running child's group, then exit as the signal would."""
    with _LOCK:
        groups = list(_LIVE)
    for pgid in groups:
        _kill_group(pgid)
    raise SystemExit(128 + signum)


def install_handlers() -> None:
    """Stop every child group when the bench is stopped (SIGTERM, SIGINT)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_all)
