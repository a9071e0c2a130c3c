"""A file written whole or not at all (exports and reports): written beside its name, then renamed
over it; never over the results database being read, a job's lock or log, or the job's own files."""
from __future__ import annotations

import contextlib
import glob
import os
import re
import stat
import time
from pathlib import Path
from typing import Callable, Optional

from runner.errors import OutputFileError
from runner.lock import process_alive


def write_whole(path: Path, write: Callable[[Path], None], reading: Optional[Path] = None,
                check: Optional[Callable[[], None]] = None, keep: Optional[Callable[[Path], Optional[str]]] = None) -> None:
    """A file written whole or not at all: `write` fills a file beside `path`, which is then
    renamed over it, so a failed write (a full disk) leaves the file from before as it was. A
    symbolic link keeps pointing where it did, at the new file; a path that is not a regular file
    (a pipe, `/dev/stdout`, a device) is written into as it is. `reading` (the results database the
    rows come from) is refused as the path; `check` runs before the file replaces the old one (a read
    that may be mixed leaves it as it was); so is a path `keep` names (what of the job's own it is:
    unloaded_job.job_sources). Exports and reports; an OutputFileError names the path."""
    target = Path(os.path.realpath(path))
    if reading is not None and _same_database(target, reading):
        raise OutputFileError(f"{path}: is the results database being read: give another file")
    if reading is not None and _beside_database(target, reading):  # a run's lock (one run at a time) or log
        raise OutputFileError(f"{path}: is a job's lock or engine log beside the results database: give another file")
    what = keep(Path(os.path.abspath(path))) if keep else None  # links unresolved: keep checks both
    if what:  # `-o job.yaml`, `-o data/docs.parquet`: the job would be lost, or read its results as input
        raise OutputFileError(f"{path}: is {what}: give another file")
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = None  # no file yet (or a folder missing: made below)
    if mode is not None and stat.S_ISDIR(mode):
        raise OutputFileError(f"{path}: is a folder: give a file name")
    if mode is not None and not stat.S_ISREG(mode):
        try:
            write(path)
        except OSError as exc:
            raise OutputFileError(f"{path}: cannot write: {exc.strerror or exc}") from None
        if check is not None:  # written already: the exit code says what it holds
            check()
        return
    part = target.with_name(f".{target.name}.{os.getpid()}.part")  # two writers of one file: a part each
    _stale_parts(target)
    try:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:  # a file where a folder of the path should be (job.yaml/x.csv)
            raise OutputFileError(f"{path}: cannot write: {_file_in_the_way(target.parent)} is a file, "
                                  "not a folder") from None
        write(part)
        if mode is not None:  # the file replaced keeps its permissions (a 0600 export stays private)
            os.chmod(part, stat.S_IMODE(mode))
        if check is not None:
            check()
        os.replace(part, target)
    except BaseException as exc:  # a full disk, or a failure while the rows are read (the part goes too)
        with contextlib.suppress(OSError):
            part.unlink()
        if isinstance(exc, OSError):  # Arrow's errors name the file it wrote: the part, not what was asked
            why = str(exc.strerror or exc).replace(str(part), str(path))
            raise OutputFileError(f"{path}: cannot write: {why}") from None
        raise


def _file_in_the_way(folder: Path) -> Path:
    """The first of folder and its parents that exists: a file where a folder should be."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def _same_database(target: Path, db: Path) -> bool:
    """Whether target is the database file or one of SQLite's files beside it."""
    real = Path(os.path.realpath(db))
    return target in {real, *(real.with_name(real.name + x) for x in ("-wal", "-shm", "-journal"))}


def _beside_database(target: Path, db: Path) -> bool:
    """Whether target is named as a job's lock or engine log of that database: DB.JOB.lock, DB.JOB.log
    (and the log kept from before, DB.JOB.log.1)."""
    real = Path(os.path.realpath(db))
    return (target.parent == real.parent and target.name.startswith(real.name + ".")
            and (target.suffix in (".lock", ".log") or target.name.endswith(".log.1")))


def _stale_parts(target: Path) -> None:
    """Parts an earlier writer of this file left when it was killed (SIGKILL runs no cleanup), named
    by their pids: removed once no such process runs here and the part has not changed for
    STALE_PART_S (a writer on another host sharing the folder has pids of its own). A live writer's
    part is its own. Best effort: nothing here stops the write."""
    for part in target.parent.glob(f".{glob.escape(target.name)}.*.part"):
        pid = part.name[len(target.name) + 2:-len(".part")]
        if not re.fullmatch(r"[1-9][0-9]{0,9}", pid) or int(pid) == os.getpid():
            continue  # not a part this module names
        if process_alive(int(pid)):  # its writer's (another user's too; a pid out of range counts so)
            continue
        with contextlib.suppress(OSError):
            if time.time() - part.stat().st_mtime > STALE_PART_S:
                part.unlink()


STALE_PART_S = 600
