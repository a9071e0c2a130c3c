"""Where a run writes (its results database, and the job's lock file and engine log beside it):
refused before anything is written, alike by `validate` and by every command that writes."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional

from runner.errors import StoreError
from runner.store_sqlite import _foreign_tables


def nearest_existing(path: Path) -> Path:
    """The closest of path's folders that exists (a path through a file stops at the file)."""
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    return folder


def refuse_unwritable(path: Path, job_name: Optional[str] = None) -> None:
    """StoreError (exit 6) where a run could not make, write or open the database at path (said
    alike by `validate` and before a command opens the engine log beside the database), or, given
    the job's name, write its lock file or engine log there."""
    if (why := unwritable_reason(path)) is not None:
        raise StoreError(f"{path}: output.database: {why}")
    if job_name is not None:
        refuse_unwritable_beside(path, job_name)


def refuse_unwritable_beside(path: Path, job_name: str) -> None:
    """StoreError (exit 6) where something the job's lock file or engine log cannot be is in their
    place beside the database at path (a folder, a read-only file)."""
    from runner.console import log_path_for
    from runner.lock import lock_path

    for what, beside in (("lock file", lock_path(path, job_name)), ("engine log", log_path_for(path, job_name))):
        if not _writable_or_makeable(beside):
            raise StoreError(f"{beside}: the job's {what} beside its results database cannot be written: "
                             "not a writable file")


def _writable_or_makeable(path: Path) -> bool:
    """A writable file at path, or none yet (the database's own check covers its folder); a link
    counts as its target, which may be made yet in a writable folder."""
    target = Path(os.path.realpath(path))
    if target.exists():
        return target.is_file() and os.access(target, os.W_OK)
    return not path.is_symlink() or os.access(target.parent, os.W_OK | os.X_OK)


def unwritable_reason(path: Path) -> Optional[str]:
    """Why a run could not make, write or open the database at path (None: it could), found without
    writing (root excepted: see _can_write_in): the file, or the nearest folder that exists above
    it, must be writable, and a file there must be a SQLite database."""
    if path.exists():
        if path.is_dir():
            return "is a folder: name the database file in it (results.sqlite, say)"
        if not (path.is_file() and os.access(path, os.R_OK | os.W_OK)):
            return "cannot be written: not a writable file"
        with open(path, "rb") as f:  # an empty file is an empty database to SQLite
            head = f.read(16)
        if head not in (b"", b"SQLite format 3\x00"):
            return "the file there is not a SQLite database"
        foreign = _foreign_tables(path)
        if foreign:
            return f"the file there is another program's SQLite database (tables: {', '.join(foreign[:5])})"
        if not _can_write_in(path.parent):  # a run writes beside the file too
            return (f"cannot be written: {path.parent} is not a folder this user can write in (a run keeps the "
                    "database's write-ahead log, its lock and its engine log beside it)")
        return None
    folder = nearest_existing(path)
    if not folder.is_dir() or not _can_write_in(folder):
        return f"cannot be written: {folder} is not a folder this user can write in"
    return None


def _can_write_in(folder: Path) -> bool:
    """Whether a file can be made in folder. os.access says yes to root everywhere, /sys and /proc
    too: there an empty file is made and removed to know."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    if os.geteuid() != 0:
        return True
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".runner-probe-")
    except OSError:
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return True
