"""One run of a job at a time, per results database.

An advisory `flock` on a file beside the database: the kernel drops it when the holder dies,
even by SIGKILL, so a crashed run never leaves a stale lock behind.
"""
from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from runner.errors import LockedError, StoreError


def lock_path(database: Path, job_name: str) -> Path:
    """The job's lock file, beside its results database."""
    return Path(f"{database}.{job_name}.lock")


class JobLock:
    def __init__(self, database: Path, job_name: str, wait: bool = False, poll_s: float = 0.5):
        self.path = lock_path(database, job_name)
        self.wait = wait
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
                if not self.wait:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                    raise LockedError(
                        f"{self.path}: job is already running ({f'pid {holder}' if holder else 'by another process'}); "
                        "use --wait to wait for it"
                    ) from None
                time.sleep(self.poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def held(database: Path, job_name: str) -> bool:
    """Whether a process holds the job's lock now (a run, a calibration, a verification): a quick
    look, for what must not be done under a running job (its engine log moved away)."""
    try:
        fd = os.open(lock_path(database, job_name), os.O_RDWR)
    except OSError:  # no lock file: nothing ever ran, or it cannot be opened: nothing to respect
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
