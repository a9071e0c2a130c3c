"""One run of a job at a time, per results database.

An advisory `flock` on a file beside the database: the kernel drops it when the holder dies,
even by SIGKILL, so a crashed run never leaves a stale lock behind.
"""
from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import Callable, Optional

from runner.errors import LockedError, StoreError
from runner.signals import Interrupted


def lock_path(database: Path, job_name: str) -> Path:
    """The job's lock file, beside its results database's real path: a database named through a
    link to its file is one lock with the file's own name, or two runs would hold "the lock" and the
    second would mark the first's run row abandoned while it ran."""
    return Path(f"{os.path.realpath(database)}.{job_name}.lock")


class JobLock:
    def __init__(self, database: Path, job_name: str, wait: bool = False, poll_s: float = 0.5,
                 on_wait: Optional[Callable[[str], None]] = None):
        """on_wait: told once, with wait, that the job is running and this one waits for it."""
        self.path = lock_path(database, job_name)
        self.wait = wait
        self.on_wait = on_wait
        self.poll_s = poll_s
        self._fd: int | None = None

    def __enter__(self) -> "JobLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # a read-only mount, a path under a regular file, /proc...
            raise StoreError(f"{self.path}: cannot create the job's lock file beside the results database: "
                             f"{exc.strerror or exc}") from None
        try:
            self._take(fd)
        except BaseException:  # refused, or a signal while waiting: the lock and the descriptor go
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _take(self, fd: int) -> None:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                by = f"pid {holder}" if holder else "by another process"
                if not self.wait:
                    raise LockedError(f"{self.path}: job is already running ({by}); use --wait to wait for it") from None
                if self.on_wait is not None:
                    self.on_wait(f"the job is already running ({by}): waiting for it to finish")
                    self.on_wait = None
                try:
                    time.sleep(self.poll_s)
                except (Interrupted, KeyboardInterrupt) as exc:  # not "finished rows are stored": none were here
                    how = "interrupted" if isinstance(exc, KeyboardInterrupt) else str(exc).split(";")[0]
                    raise Interrupted(f"{how} while it waited for the job's lock (nothing done)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def held(database: Path, job_name: str) -> bool:
    """Whether a process may hold the job's lock now (a run, a calibration, a verification), for
    what must not be done under a running job (its engine log moved away). Read from the pid the
    holder writes into the lock file (emptied on release; a killed holder's pid names no process),
    not by taking the lock: a run starting at that moment would find it taken and exit 75."""
    return _alive_pid(lock_path(database, job_name)) is not None


def _alive_pid(path: Path) -> Optional[int]:
    """The pid written in the lock file, if a process has it. Errs towards held: a pid a killed
    holder left and another process got later reads as held (see holder)."""
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:  # no lock file: nothing ever ran
        return None
    return int(text) if text.isdigit() and process_alive(int(text)) else None


def holder(database: Path, job_name: str) -> Optional[int]:
    """The pid of the process that holds the job's lock now, as `status` says it, or None. A killed
    holder's pid stays in the file, and another process may get that pid later: where the kernel
    lists its locks (/proc/locks), the pid counts only if it, or the file, holds one. (held() does
    not ask: a filesystem whose locks the kernel does not list, FUSE's, would read as unlocked.)"""
    path = lock_path(database, job_name)
    pid = _alive_pid(path)
    locks = flock_holders() if pid is not None else None
    if locks is None:
        return pid
    try:
        st = path.stat()
    except OSError:
        return None
    pids, files = locks
    # either may miss: another pid namespace lists other pids, an overlay filesystem other inodes
    return pid if pid in pids or (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in files else None


def flock_holders(proc_locks: str = "/proc/locks") -> Optional[tuple[set[int], set[tuple[int, int, int]]]]:
    """(pids, (major, minor, inode) of files) holding flock locks, from Linux's lock table; None
    where it cannot be read. A process waiting for a lock is listed after "->": not a holder."""
    try:
        with open(proc_locks) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    pids, files = set(), set()
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK":  # "N: -> FLOCK ..." is a waiter; POSIX locks are not ours
            continue
        try:
            major, minor, inode = parts[5].split(":")
            pids.add(int(parts[4]))
            files.add((int(major, 16), int(minor, 16), int(inode)))
        except ValueError:
            continue
    return pids, files


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process (or a pid out of range: refused)
        return True
    return True
