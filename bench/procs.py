"""The benchmark's child processes, each in a process group of its own.

A configuration is one process, but vLLM starts its engine core as a child of it, and that child
holds the GPU's memory. subprocess.run's timeout kills only the direct child, and a bench stopped
by a signal killed none: the engine core lived on, and the next run on that GPU failed to start
(seen on the H200: "Free memory on device cuda:0 (8.89/139.8 GiB) on startup is less than desired").
Here a timeout stops the whole group, and the bench's SIGTERM/SIGINT/SIGHUP handler (`stop_all`)
stops every group still running; a run started after that is stopped at once. Stopping is
SIGTERM first (the runner then records its run as interrupted), SIGKILL after a grace period.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

GRACE_S = 10.0  # after SIGTERM, before SIGKILL
# Process group ids of the children running now. No lock: a set's add and discard are atomic under
# the GIL, and the signal handler, which runs between the main thread's bytecodes, could not take
# a lock that thread holds.
_LIVE: set[int] = set()
_STOPPING = threading.Event()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_group(pgid: int, grace_s: float = GRACE_S, leader: subprocess.Popen | None = None) -> None:
    """SIGTERM to every process of the group, then SIGKILL to what is left after grace_s (an
    exited leader is reaped meanwhile: a zombie would keep the group alive)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    end = time.monotonic() + grace_s
    while time.monotonic() < end and _group_alive(pgid):
        if leader is not None:
            leader.poll()
        else:  # stop_all: the leader is our child; its Popen may be waiting in the interrupted thread
            try:
                os.waitpid(pgid, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def spawn(cmd: list[str], **popen) -> subprocess.Popen:
    """subprocess.Popen(cmd) as the leader of a new process group, registered for stop_all."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    _LIVE.add(proc.pid)
    if _STOPPING.is_set():  # the bench is stopping: stop_all's snapshot may have missed this one
        stop_group(proc.pid, grace_s=0)
    return proc


def finish(proc: subprocess.Popen, timeout: float | None = None, grace_s: float = GRACE_S) -> tuple:
    """proc.communicate(); on a timeout the whole group is stopped, then TimeoutExpired raised.
    What the group still holds once the leader has exited (an engine core that outlived its
    parent) is stopped too. Returns (stdout, stderr)."""
    try:
        return proc.communicate(timeout=timeout)
    except BaseException:
        stop_group(proc.pid, grace_s, leader=proc)
        proc.communicate()
        raise
    finally:
        stop_group(proc.pid, grace_s=0)
        _LIVE.discard(proc.pid)


def run_group(cmd: list[str], *, timeout: float | None = None, **popen) -> subprocess.CompletedProcess:
    """subprocess.run(cmd) in a new process group (see finish)."""
    proc = spawn(cmd, **popen)
    out, err = finish(proc, timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop_all(signum: int = signal.SIGTERM, *_frame) -> None:
    """Stop every running child's group, then exit as the signal would."""
    _STOPPING.set()
    for pgid in list(_LIVE):
        stop_group(pgid)
    raise SystemExit(128 + signum)


def install_handlers() -> None:
    """Stop every child group when the bench is stopped (SIGTERM, SIGINT, SIGHUP)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop_all)
