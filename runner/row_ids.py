"""The input's row ids on disk, so that a million-row input is checked for duplicate ids and
counted against the stored results in bounded memory (SQLite's page cache, not a Python set)."""
from __future__ import annotations

import os
import sqlite3
import tempfile
from pathlib import Path
from typing import Iterable, Optional


class RowIds:
    """A temporary SQLite file of ids (unique), deleted on close."""

    def __init__(self, folder: Optional[str] = None):
        if folder is None:  # the process's own: a killed run's file goes with the next run (runner/scratch.py)
            from runner.scratch import scratch_dir

            folder = str(scratch_dir())
        fd, path = tempfile.mkstemp(prefix="runner-ids-", suffix=".sqlite", dir=folder)
        os.close(fd)
        self.path = Path(path)
        self.count = 0
        self._con = sqlite3.connect(path, isolation_level=None)
        self._con.execute("PRAGMA journal_mode=OFF")  # scratch data: a crash loses nothing of value
        self._con.execute("PRAGMA synchronous=OFF")
        self._con.execute("PRAGMA cache_size=-16384")  # 16 MiB, whatever the input's size
        self._con.execute("CREATE TABLE ids (id TEXT PRIMARY KEY) WITHOUT ROWID")

    def add(self, ids: list[str]) -> Optional[str]:
        """Add a batch of ids; return the first one already present (the batch is then not added)."""
        con = self._con
        con.execute("BEGIN")
        try:
            con.executemany("INSERT INTO ids VALUES (?)", ((i,) for i in ids))
        except sqlite3.IntegrityError:
            con.execute("ROLLBACK")
            return self._first_duplicate(ids)
        con.execute("COMMIT")
        self.count += len(ids)
        return None

    def add_keep_first(self, ids: list[str]) -> list[int]:
        """Add a batch of ids; return the positions of those already present (not added again)."""
        if self.add(ids) is None:
            return []
        dup, con = [], self._con
        con.execute("BEGIN")
        for n, i in enumerate(ids):
            if con.execute("INSERT OR IGNORE INTO ids VALUES (?)", (i,)).rowcount == 0:
                dup.append(n)
        con.execute("COMMIT")
        self.count += len(ids) - len(dup)
        return dup

    def _first_duplicate(self, ids: list[str]) -> str:
        seen: set[str] = set()
        for i in ids:
            if i in seen or self._con.execute("SELECT 1 FROM ids WHERE id = ?", (i,)).fetchone():
                return i
            seen.add(i)
        raise AssertionError("an IntegrityError without a duplicate id")

    def __contains__(self, row_id: str) -> bool:
        return self._con.execute("SELECT 1 FROM ids WHERE id = ?", (row_id,)).fetchone() is not None

    def __iter__(self) -> Iterable[str]:
        return (r[0] for r in self._con.execute("SELECT id FROM ids"))

    def close(self) -> None:
        if self._con is not None:
            self._con.close()
            self._con = None
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "RowIds":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # a scan dropped without close() still leaves no file behind
        try:
            self.close()
        except Exception:
            pass
