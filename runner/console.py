"""Where the runner's own output goes, and where the engine's goes.

vLLM, torch and their C++ code write to the process's stdout and stderr (file descriptors 1 and
2): log lines, warnings, progress bars of their own. vLLM's engine-core processes inherit those
descriptors. During a run both descriptors point to a log file beside the database (or to stderr
with -v), so that cron mails nothing on success; the runner's own messages (progress, summary,
errors) reach the terminal through copies of the original descriptors.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Optional, TextIO

from runner.errors import StoreError

# A job run from cron appends to its engine log every night (~15 KB a short GPU run, ~200 KB an hour
# of vLLM's 5-second stats): past this size a run starts a new log and keeps the last one as .1.
LOG_KEEP_BYTES = 32 << 20


@dataclass
class Console:
    out: TextIO
    err: TextIO


_current: Optional[Console] = None


def console() -> Console:
    """The streams for the runner's own messages."""
    return _current or Console(sys.stdout, sys.stderr)


def log_path_for(database: Path, job_name: str) -> Path:
    """The engine log of a job, beside its results database (as its lock file is)."""
    return Path(f"{database}.{job_name}.log")


def rotate_if_large(log: Path, limit: int) -> Optional[Path]:
    """Move a log of `limit` bytes or more to LOG.1 (replacing an older one), so that a nightly job's
    log does not grow without end; the path it went to, or None. A log another process rotated or
    is writing meanwhile is left as it is (that process keeps writing to the file it opened); so is
    a link (the user's own place for it, rotated there)."""
    try:
        if log.is_symlink() or log.stat().st_size < limit:
            return None
        kept = log.with_name(log.name + ".1")
        os.replace(log, kept)
        return kept
    except OSError:  # gone meanwhile, or not ours to move: appending to it is still right
        return None


def _terminal(stream: TextIO, fd: int) -> tuple[TextIO, Optional[int]]:
    """A stream that keeps reaching where `stream` goes once descriptor `fd` is redirected."""
    try:
        if stream.fileno() != fd:
            return stream, None
    except (AttributeError, OSError, ValueError):  # not a real file (a test runner's buffer)
        return stream, None
    stream.flush()
    dup = os.dup(fd)
    return os.fdopen(dup, "w", buffering=1, encoding=getattr(stream, "encoding", None) or "utf-8",
                     errors="replace", closefd=False), dup


@contextmanager
def engine_output_to(log: Optional[Path], header: str = "") -> Iterator[Console]:
    """Point descriptors 1 and 2 at `log` (appended; None: at stderr) for the duration; yield the
    console that still reaches the terminal."""
    global _current
    out, out_fd = _terminal(sys.stdout, 1)
    err, err_fd = _terminal(sys.stderr, 2)
    saved = (os.dup(1), os.dup(2))
    made = [] if log is None else [p for p in (log.parent, log) if not p.exists()]  # ours to remove on failure
    try:
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        else:
            target = os.dup(err_fd if err_fd is not None else 2)
    except OSError as exc:
        for fd in (*saved, out_fd, err_fd):
            if fd is not None:
                os.close(fd)
        raise StoreError(f"{log}: cannot write the engine log beside the results database: "
                         f"{exc.strerror or exc}") from None
    written = f"==== {datetime.now(timezone.utc).isoformat(timespec='seconds')} {header}\n".encode() if header else b""
    os.write(target, written)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    previous, _current = _current, Console(out, err)
    try:
        yield _current
    except BaseException:
        _remove_if_untouched(made, len(written))
        raise
    finally:
        _current = previous
        for stream in (sys.stdout, sys.stderr, out, err):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, out_fd, err_fd):
            if fd is not None:
                os.close(fd)


def _remove_if_untouched(made: list[Path], header_bytes: int) -> None:
    """A command that failed before anything wrote to the log it created (bad input, a bad job)
    leaves no log file, and no folder made for it."""
    for path in reversed(made):
        try:
            if path.is_file() and path.stat().st_size <= header_bytes:
                path.unlink()
            elif path.is_dir():
                path.rmdir()  # only when empty
        except OSError:
            pass


class RunBar:
    """A tqdm bar that says the engine is starting until it is up, then restarts its clock, so that
    its elapsed time, rate and ETA are generation's: vLLM's import and start take tens of seconds."""

    def __init__(self, total: int, name: str, file, mininterval: float):
        from tqdm import tqdm

        self.name = name
        self.bar = tqdm(total=total, desc=f"{name} (starting the engine)", unit="doc", file=BestEffort(file),
                        dynamic_ncols=True, mininterval=mininterval, smoothing=0.1)

    def engine_started(self) -> None:
        """The first engine is up (a later one, calibration's, keeps the count and the clock)."""
        if self.bar.n == 0 and self.bar.desc != self.name:
            self.bar.set_description_str(self.name, refresh=False)
            self.bar.reset()

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


class BestEffort:
    """A stream for progress and notes: a write that fails (stderr on a full disk, a reader that
    stopped reading) drops this and later output instead of stopping the run that makes it."""

    def __init__(self, stream: TextIO):
        self.stream, self.failed = stream, False

    def write(self, text: str) -> int:
        if not self.failed:
            try:
                self.stream.write(text)
            except (OSError, ValueError):  # ValueError: the stream was closed
                self.failed = True
        return len(text)

    def flush(self) -> None:
        if not self.failed:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self.failed = True

    def __getattr__(self, name: str):  # isatty, encoding...: tqdm asks
        if name == "stream":  # not set yet (copy, pickle): no recursion through this
            raise AttributeError(name)
        return getattr(self.stream, name)
